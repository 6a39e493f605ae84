"""Where a megakernel's warps stall, by region of its SASS: reads the per-instruction CSV that
scripts/gpu_backward_profile.sh exports (ncu --page source --csv --print-source sass, gzipped) and prints, per window
of N instructions, the share of all stall samples, the most executions of an instruction there (how hot the window
is), the landmark instructions it holds (HGMMA, MUFU, STG, LDS, LDL/STL spills, ...) and its top stall reasons;
then the --top instructions with the most samples.

    python scripts/lab/sass_regions.py bwd_sass.csv.gz [--window 256] [--min-share 0.005] [--top 25]

A lab script (issue 33's profiling), not part of the package.
"""
import argparse
import collections
import csv
import gzip

MARKS = ("HGMMA", "MUFU.EX2", "MUFU.RCP", "STG", "LDG", "LDS", "STS", "STL", "LDL", "SYNCS", "UTMA", "ATOM", "RED",
         "SHFL", "F2FP")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--min-share", type=float, default=0.005)
    ap.add_argument("--top", type=int, default=25, help="the instructions with the most stall samples (0: none)")
    a = ap.parse_args()
    rows = list(csv.reader(gzip.open(a.csv, "rt") if a.csv.endswith(".gz") else open(a.csv)))
    head = next(i for i, r in enumerate(rows) if "Address" in r)
    cols, body = rows[head], rows[head + 1:]
    i_s, i_ex = cols.index("Warp Stall Sampling (All Samples)"), cols.index("Instructions Executed")
    reasons = [(c, i) for i, c in enumerate(cols) if c.startswith("stall_") and "Not Issued" not in c]
    total = sum(float(r[i_s] or 0) for r in body) or 1.0
    print(f"{len(body)} instructions, {total:.0f} stall samples")
    for k in range(0, len(body), a.window):
        seg = body[k:k + a.window]
        share = sum(float(r[i_s] or 0) for r in seg) / total
        if share < a.min_share:
            continue
        marks, why = collections.Counter(), collections.Counter()
        for r in seg:
            words = r[1].split()
            op = words[1] if words and words[0].startswith("@") and len(words) > 1 else (words[0] if words else "")
            for m in MARKS:
                if op.startswith(m):
                    marks[m] += 1
            for c, i in reasons:
                why[c[6:]] += float(r[i] or 0)
        seg_total = sum(why.values()) or 1.0
        print(f"{k:6d} {share:6.2%} exec<={max(int(r[i_ex] or 0) for r in seg):9d}  "
              + " ".join(f"{m}:{n}" for m, n in marks.items()) + "  | "
              + ", ".join(f"{c} {v / seg_total:.0%}" for c, v in why.most_common(3)))
    if a.top:
        print(f"the {a.top} instructions with the most stall samples (share, index, SASS):")
        ranked = sorted(range(len(body)), key=lambda i: -float(body[i][i_s] or 0))[:a.top]
        for i in ranked:
            print(f"  {float(body[i][i_s] or 0) / total:6.1%}  {i:6d}  {body[i][1].strip()[:100]}")


if __name__ == "__main__":
    main()
