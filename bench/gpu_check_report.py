"""The one results file of bench/gpu_check.sh: OUT/results.md and OUT/results.json.

gpu_check.sh calls ``record`` after every step (name, title, status, seconds, timeout, note,
and the step's own files), which appends to OUT/steps.jsonl and rewrites both results files,
so a run cut short still leaves them describing every step that ran. Standard library only
(no torch import): it runs in a few milliseconds between steps.

    python bench/gpu_check_report.py record --out OUT --name graph --title "..." --status ok \\
        --seconds 8 --timeout 30 [--note TEXT] [--md FILE] [--json FILE] [--log FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

LOG_TAIL_LINES = 25


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="add one step's outcome and rewrite results.md / results.json")
    rec.add_argument("--out", required=True, help="gpu_check.sh's output folder")
    rec.add_argument("--name", required=True, help="the step's short name")
    rec.add_argument("--title", required=True, help="what the step checks, one line")
    rec.add_argument("--status", required=True, choices=("ok", "failed", "timeout", "skipped"))
    rec.add_argument("--seconds", type=float, default=0.0, help="wall time of the step")
    rec.add_argument("--timeout", type=float, default=0.0, help="the step's time limit (0: none)")
    rec.add_argument("--note", default="", help="one line: why it failed or was skipped, or a summary")
    rec.add_argument("--md", default=None, help="the step's markdown fragment (included as is)")
    rec.add_argument("--json", default=None, help="the step's JSON result (included under the step)")
    rec.add_argument("--log", default=None, help="the step's log (its last lines are included)")
    rec.add_argument("--junit", default=None, help="a pytest junit XML (its counts are included)")
    return ap.parse_args(argv)


def junit_counts(path: Path) -> dict | None:
    if not path.is_file():
        return None
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    try:
        for suite in ET.parse(path).getroot().iter("testsuite"):
            for key in counts:
                counts[key] += int(suite.get(key, 0))
    except ET.ParseError:
        return None
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def read_text(path: str | None) -> str | None:
    if path and Path(path).is_file():
        return Path(path).read_text(errors="replace")
    return None


def step_entry(args) -> dict:
    entry = dict(name=args.name, title=args.title, status=args.status, seconds=round(args.seconds, 1),
                 timeout=args.timeout, note=args.note)
    if args.junit:
        entry["pytest"] = junit_counts(Path(args.junit))
    data = read_text(args.json)
    if data:
        try:
            entry["result"] = json.loads(data)
        except json.JSONDecodeError:
            entry["result_unreadable"] = args.json
    entry["md"] = read_text(args.md)
    log = read_text(args.log)
    if log is not None:
        entry["log_tail"] = "\n".join(log.rstrip().splitlines()[-LOG_TAIL_LINES:])
    return entry


def markdown(steps: list[dict], env: str | None) -> str:
    lines = ["# specplug GPU check", ""]
    if env:
        lines += ["```", env.rstrip(), "```", ""]
    lines += ["| step | status | seconds | limit | note |", "| --- | --- | --- | --- | --- |"]
    for s in steps:
        note = s["note"].replace("|", "/").replace("\n", " ")
        lines.append(f"| {s['name']} | {s['status']} | {s['seconds']:.0f} | {s['timeout']:.0f} | {note} |")
    for i, s in enumerate(steps, 1):
        limit = f" (limit {s['timeout']:.0f} s)" if s["timeout"] else ""
        note = f"; {s['note']}" if s["note"] else ""
        lines += ["", f"## {i}. {s['name']}: {s['title']}", "",
                  f"status: **{s['status']}** after {s['seconds']:.0f} s{limit}{note}"]
        if s.get("pytest"):
            p = s["pytest"]
            lines.append(f"pytest: {p['passed']} passed, {p['failures']} failed, {p['errors']} errors, "
                         f"{p['skipped']} skipped")
        if s.get("md"):
            lines += ["", s["md"].rstrip()]
        if s.get("log_tail") and (s["status"] != "ok" or not s.get("md")):
            lines += ["", "```", s["log_tail"], "```"]
    return "\n".join(lines) + "\n"


def record(args) -> int:
    out = Path(args.out)
    with (out / "steps.jsonl").open("a") as f:
        f.write(json.dumps(step_entry(args)) + "\n")
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines() if line.strip()]
    env = read_text(str(out / "env.txt"))
    (out / "results.md").write_text(markdown(steps, env))
    summary = {s["name"]: s["status"] for s in steps}
    results = dict(env=env, summary=summary, steps=[{k: v for k, v in s.items() if k != "md"} for s in steps])
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    return record(args)


if __name__ == "__main__":
    sys.exit(main())
