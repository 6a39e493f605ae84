# Header-only dependencies, found through the Python environment that builds the package:
#   MOK_XLA_FFI_INCLUDE  - xla/ffi/api/ffi.h, shipped in jaxlib (jax.ffi.include_dir())
#   MOK_CUTLASS_INCLUDE  - cute/ and cutlass/, shipped in the nvidia-cutlass wheel
# Either can be overridden on the command line (-DMOK_XLA_FFI_INCLUDE=...).
find_package(Python COMPONENTS Interpreter REQUIRED)
find_package(CUDAToolkit REQUIRED)

if(NOT MOK_XLA_FFI_INCLUDE)
  execute_process(
    COMMAND ${Python_EXECUTABLE} -c "import os, jaxlib; print(os.path.join(os.path.dirname(jaxlib.__file__), 'include'))"
    OUTPUT_VARIABLE MOK_XLA_FFI_INCLUDE OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _rc)
  if(NOT _rc EQUAL 0 OR NOT EXISTS "${MOK_XLA_FFI_INCLUDE}/xla/ffi/api/ffi.h")
    message(FATAL_ERROR "mok_jax: XLA FFI headers not found; install jaxlib in the build environment")
  endif()
endif()

if(NOT MOK_CUTLASS_INCLUDE)
  execute_process(
    COMMAND ${Python_EXECUTABLE} -c "import os, cutlass_library; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include'))"
    OUTPUT_VARIABLE MOK_CUTLASS_INCLUDE OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _rc)
  if(NOT _rc EQUAL 0 OR NOT EXISTS "${MOK_CUTLASS_INCLUDE}/cute/tensor.hpp")
    message(FATAL_ERROR "mok_jax: CuTe/CUTLASS headers not found; install nvidia-cutlass in the build environment")
  endif()
endif()
message(STATUS "mok_jax: XLA FFI headers in ${MOK_XLA_FFI_INCLUDE}")
message(STATUS "mok_jax: CuTe/CUTLASS headers in ${MOK_CUTLASS_INCLUDE}")
