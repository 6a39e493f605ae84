"""Every markdown file of the repository points only at files inside the repository (issue 11, item 6).

Scans each ``*.md`` file outside ``.venv``, ``build``, ``ab`` and hidden folders, and checks:

- Markdown links and images (``[text](target)``), reference definitions (``[name]: target``) and HTML
  ``href=``/``src=`` attributes. A relative target must exist in the repository, must not climb above its
  root, and must not lie in an ignored folder. A ``#fragment`` into a markdown file must name one of its
  headings. ``http``, ``https`` and ``mailto`` links are allowed; any other scheme, and any absolute path, is
  refused.
- Path-like words in inline code (``../shared/DESIGN.md``, ``/work/...``): they need not exist (commands
  may name files they create), but they must not point outside the repository. In code blocks, which
  often quote logs and commands recorded on the machine that ran them, only a relative path that climbs
  above the repository root is refused.

Paths resolve from the markdown file's own folder, as a link does on GitHub.
"""

from __future__ import annotations

import os
import pathlib
import re
import urllib.parse

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent

# Folders that hold local build outputs or tools, never part of a clone: not scanned, never a link target
# (ab: scripts/ab_tree.sh's trees, each with a copy of README.md).
IGNORED_DIRS = frozenset({".venv", "build", "out", "ab", "__pycache__", ".git", ".pytest_cache"})
ALLOWED_SCHEMES = frozenset({"http", "https", "mailto"})
# Absolute paths a text may name without pointing into someone's machine: directories every Linux system has.
SYSTEM_ROOTS = ("/dev/", "/proc/", "/sys/", "/usr/", "/etc/", "/opt/", "/bin/", "/lib/")

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)((?:(?!\n[ \t]*\n).)+?)(?<!`)\1(?!`)", re.S)
_LINK = re.compile(
    r"(?<!\\)!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]"                  # [text], one level of nested brackets
    r"\(\s*(<[^>\n]*>|[^\s()]*(?:\([^\s()]*\)[^\s()]*)*)"       # (target, balanced parentheses allowed
    r"(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)")            #  "optional title")
_REF_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>\n]*>|\S+)", re.M)
_HTML_ATTR = re.compile(r"""\b(?:href|src)\s*=\s*["']([^"']*)["']""", re.I)
_ATX = re.compile(r"^ {0,3}#{1,6}[ \t]+(.*?)[ \t]*#*[ \t]*$")
_SETEXT = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")
_HTML_ID = re.compile(r"""\b(?:id|name)\s*=\s*["']([^"']+)["']""", re.I)
_PATH_WORD = re.compile(r"""[^\s`'"()\[\],;=|&]+""")  # <placeholder> and ${VAR} stay in a word


def markdown_files(root: pathlib.Path = REPO) -> list[pathlib.Path]:
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in IGNORED_DIRS and not d.startswith("."))
        out += [pathlib.Path(folder) / f for f in sorted(files) if f.endswith(".md")]
    return out


def _split_fences(text: str) -> tuple[str, list[tuple[int, str]]]:
    """The text with fenced code blocks blanked (lines kept, so line numbers stay), and the blocks' lines."""
    prose, code = [], []
    fence = None
    for n, line in enumerate(text.split("\n"), 1):
        m = _FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)
            prose.append("")
        elif fence is not None:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not line.strip(fence[0] + " \t"):
                fence = None
            else:
                code.append((n, line))
            prose.append("")
        else:
            prose.append(line)
    return "\n".join(prose), code


def _indented_code(prose: str) -> list[tuple[int, str]]:
    """Lines of indented code blocks (4+ spaces after a blank line, not inside a list)."""
    out, in_block, prev_blank, in_list = [], False, True, False
    for n, line in enumerate(prose.split("\n"), 1):
        blank = not line.strip()
        if re.match(r"^ {0,3}([-*+]|\d+[.)])\s", line):
            in_list = True
        elif not blank and not line.startswith(" "):
            in_list = False
        if line.startswith("    ") and not blank and (in_block or (prev_blank and not in_list)):
            in_block = True
            out.append((n, line))
        elif not blank:
            in_block = False
        prev_blank = blank
    return out


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: the rendered text, lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
    """The #fragments a link into ``path`` may use: heading slugs (numbered when repeated) and HTML ids."""
    prose, _ = _split_fences(path.read_text(encoding="utf-8"))
    lines = prose.split("\n")
    seen: dict[str, int] = {}
    out = set(_HTML_ID.findall(prose))
    for i, line in enumerate(lines):
        m = _ATX.match(line)
        title = m.group(1) if m else None
        if title is None and i + 1 < len(lines) and line.strip() and _SETEXT.match(lines[i + 1]):
            if not _SETEXT.match(line) and not line.startswith(("    ", "\t")):
                title = line.strip()
        if title is None:
            continue
        slug = _slug(title)
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def _inside(path: pathlib.Path, root: pathlib.Path) -> bool:
    return path == root or root in path.parents


def _link_problem(md: pathlib.Path, target: str, root: pathlib.Path) -> str | None:
    """Why ``target`` (a link in ``md``) is not a link inside the repository, or None when it is."""
    target = target.strip()
    if target.startswith("<") and target.endswith(">"):
        target = target[1:-1].strip()
    if not target:
        return "empty link target"
    scheme = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*):", target)
    if scheme:
        name = scheme.group(1).lower()
        return None if name in ALLOWED_SCHEMES else f"scheme {name}: points outside the repository"
    if target.startswith("//"):
        return "a protocol-relative URL points outside the repository"
    path_part, _, fragment = target.partition("#")
    path_part = urllib.parse.unquote(path_part.partition("?")[0])
    fragment = urllib.parse.unquote(fragment)
    if path_part.startswith(("/", "~")):
        return "an absolute path: use a path relative to this file"
    dest = pathlib.Path(os.path.normpath(md.parent / path_part)) if path_part else md
    if not _inside(dest, root):
        return "points outside the repository"
    rel = dest.relative_to(root)
    if any(part in IGNORED_DIRS for part in rel.parts):
        return f"points into {'/'.join(rel.parts[:1])}/, which a clone does not have"
    if not dest.exists():
        return "does not exist in the repository"
    if not _inside(dest.resolve(), root.resolve()):
        return "is a symbolic link to a place outside the repository"
    if fragment and dest.is_file() and dest.suffix == ".md" and fragment not in anchors(dest):
        return f"{rel} has no heading with anchor #{fragment}"
    return None


def _path_word_problem(md: pathlib.Path, word: str, root: pathlib.Path, *, absolute_ok: bool) -> str | None:
    """Why a path-like word of code text points outside the repository, or None. absolute_ok: a code block,
    where absolute paths are records of where a run wrote something, not references to follow."""
    word = word.rstrip(".:")
    if absolute_ok and word.startswith(("/", "~")):
        return None
    if word.startswith("~/"):
        return "a path in a home folder is outside the repository"
    if word.startswith("/") and re.match(r"^/[A-Za-z_]", word):
        if word.startswith(SYSTEM_ROOTS):
            return None
        return "an absolute path is outside the repository"
    if word.startswith(("../", "./")) or word == "..":
        if not _inside(pathlib.Path(os.path.normpath(md.parent / word)), root):
            return "climbs above the repository root"
    return None


def check_markdown(md: pathlib.Path, root: pathlib.Path = REPO) -> list[str]:
    """Every problem of one markdown file, as 'file:line: target: why'."""
    text = md.read_text(encoding="utf-8")
    prose, code = _split_fences(text)
    rel = md.relative_to(root)
    problems = []

    def report(line: int, target: str, why: str | None):
        if why:
            problems.append(f"{rel}:{line}: {target}: {why}")

    def line_of(s: str, pos: int) -> int:
        return s.count("\n", 0, pos) + 1

    spans = list(_CODE_SPAN.finditer(prose))
    links_text = prose
    for m in reversed(spans):  # blank the code spans (keeping newlines) before looking for links
        links_text = links_text[:m.start()] + re.sub(r"[^\n]", " ", m.group(0)) + links_text[m.end():]
    indented = _indented_code(links_text)
    indented_lines = {n for n, _ in indented}
    links_text = "\n".join("" if n in indented_lines else line
                           for n, line in enumerate(links_text.split("\n"), 1))

    for pattern in (_LINK, _REF_DEF, _HTML_ATTR):
        for m in pattern.finditer(links_text):
            report(line_of(links_text, m.start()), m.group(1), _link_problem(md, m.group(1), root))
    inline = [(line_of(prose, m.start()), m.group(2), False) for m in spans]
    blocks = [(n, line, True) for n, line in code + indented]
    for line, content, in_block in inline + blocks:
        for w in _PATH_WORD.finditer(content):
            report(line, w.group(0), _path_word_problem(md, w.group(0), root, absolute_ok=in_block))
    return problems


# ----------------------------------------------------------------------------- the repository


def test_the_scan_covers_the_docs():
    found = {p.relative_to(REPO).as_posix() for p in markdown_files()}
    for must in ("README.md", "docs/design.md", "docs/kernel.md", "docs/protocol.md", "docs/errors.md"):
        assert must in found, f"{must} is missing or not scanned (found {sorted(found)})"
    assert not any(p.split("/")[0] in IGNORED_DIRS or p.startswith(".") for p in found)


@pytest.mark.parametrize("md", markdown_files(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_links_stay_inside_the_repository(md):
    problems = check_markdown(md)
    assert not problems, "links or paths that leave the repository:\n  " + "\n  ".join(problems)


# ----------------------------------------------------------------------------- the checker itself


def _repo(tmp_path: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    root = tmp_path / "repo"
    for name, body in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(body, encoding="utf-8")
    return root


def test_checker_accepts_good_links(tmp_path):
    root = _repo(tmp_path, {
        "README.md": "See [design](docs/design.md#the-layer-computes) and ![plot](docs/p.png), "
                     "[site](https://example.com/x), [mail](mailto:a@b.c), [top](#readme).\n\n# readme\n",
        "docs/design.md": "# The layer computes\n\n[back](../README.md) [code](../src/) `../src/x.py` "
                          "`/usr/local/cuda` `make ./build.sh` `configs/<device>/t.toml`\n\n"
                          "```cpp\nauto f = [&]() { g(\"../x\"); };\n```\n\n"
                          "    loaded from /work/main/build/lib.so (a log recorded on another machine)\n",
        "docs/p.png": "", "src/x.py": "",
    })
    assert check_markdown(root / "README.md", root) == []
    assert check_markdown(root / "docs/design.md", root) == []


@pytest.mark.parametrize("body,why", [
    ("[d](../shared/DESIGN.md)", "points outside the repository"),
    ("in `../shared/DESIGN.md`", "climbs above the repository root"),
    ("[d](/work/shared/DESIGN.md)", "an absolute path"),
    ("run `cat /work/shared/DESIGN.md`", "an absolute path is outside"),
    ("```\ncat ../../outside.md\n```", "climbs above the repository root"),
    ("Run:\n\n    cat ../../outside.md\n", "climbs above the repository root"),
    ("[gone](missing.md)", "does not exist"),
    ("[x](docs/a.md#no-such-heading)", "no heading with anchor"),
    ("[f](file:///etc/passwd)", "scheme file"),
    ("[lib](build/libx.so)", "which a clone does not have"),
    ("[ref]: ../elsewhere.md", "points outside the repository"),
    ('<a href="../../x.md">x</a>', "points outside the repository"),
])
def test_checker_refuses_links_that_leave(tmp_path, body, why):
    root = _repo(tmp_path, {"README.md": body + "\n", "docs/a.md": "# A heading\n", "build/libx.so": ""})
    problems = check_markdown(root / "README.md", root)
    assert len(problems) == 1 and why in problems[0], problems


def test_checker_numbers_repeated_headings(tmp_path):
    root = _repo(tmp_path, {"a.md": "# Notes\n\n## Notes\n\nSetext\n------\n\n### `code` and (parens)!\n"})
    assert anchors(root / "a.md") == {"notes", "notes-1", "setext", "code-and-parens"}
