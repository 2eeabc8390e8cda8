"""The demo's terminal output without starting an engine: the table on fixed numbers, and
the log redirection (what engines and their child processes write lands in the log file,
the demo's own lines on the terminal)."""

import subprocess
import sys

from specplug.vllm_eagle3 import demo


def _row(method, label, tok_per_s, tau, identical=4, num_drafts=0, decode_steps=252):
    return {"method": method, "label": label, "tok_per_s": tok_per_s, "speedup": tok_per_s / 50.0,
            "tau": tau, "identical_outputs": identical, "num_outputs": 4, "num_drafts": num_drafts,
            "decode_steps": decode_steps, "acceptance_per_position": [0.25, 0.05],
            "specplug_active": method == "specplug"}


ROWS = [_row("none", "no speculation", 50.0, 1.0),
        _row("specplug", "specplug EAGLE-3", 61.5, 1.31, num_drafts=192, decode_steps=192),
        _row("ngram", "vLLM built-in ngram", 55.25, 1.62, num_drafts=40, decode_steps=230)]


def test_table_marks_the_fastest_row_and_formats_the_numbers():
    lines = demo.table(ROWS, temperature=0.0).splitlines()
    assert lines[0] == "| method | tok/s | speed-up | tau | outputs identical to no speculation |"
    assert lines[2] == "| no speculation | 50.0 | 1.00x | 1.00 | 4/4 |"
    assert lines[3] == "| **specplug EAGLE-3** (best) | 61.5 | 1.23x | 1.31 | 4/4 |"
    assert lines[4] == "| vLLM built-in ngram | 55.2 | 1.10x | 1.62 | 4/4 |"
    assert len(lines) == 5


def test_greedy_best_row_must_match_no_speculation():
    rows = [ROWS[0], ROWS[1], _row("ngram", "vLLM built-in ngram", 90.0, 1.6, identical=3)]
    assert demo.best_row(rows, temperature=0.0)["method"] == "specplug"
    assert demo.best_row(rows, temperature=0.7)["method"] == "ngram"  # sampled: outputs differ anyway
    assert "- (sampled)" in demo.table(rows, temperature=0.7)


def test_report_has_one_table_and_flags_a_sparse_drafter():
    result = {"model": "M", "head": "H", "head_trained": True, "prompts": "mtbench x 4", "max_tokens": 64,
              "batch_size": 1, "temperature": 0.0, "seed": 0, "depth": 4, "machine": "x86_64, 2 cores",
              "rows": ROWS, "acceptance_per_position": [0.25, 0.05], "specplug_active": True}
    text = demo.report(result)
    assert text.count("| method |") == 1
    assert "vLLM built-in ngram drafted at 40 of 230 decode steps" in text
    assert "specplug EAGLE-3 drafted" not in text
    assert "NO" not in text


def test_options_keep_the_old_ones_and_add_log_file_and_no_builtin():
    import argparse

    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args(["--no-builtin", "--log-file", "x.log", "--json"])
    assert args.no_builtin and args.log_file == "x.log" and args.json
    assert (args.num_prompts, args.max_tokens, args.batch_size, args.temperature) == (4, 64, 1, 0.0)


# Run in a child so sys.stdout and sys.stderr are the real descriptors 1 and 2, as in the
# demo (under pytest's capture they are not); its own child writes straight to the fds.
REDIRECT_SCRIPT = r"""
import logging, subprocess, sys
from pathlib import Path
from specplug.vllm_eagle3 import demo
handlers = list(logging.getLogger().handlers)
with demo.output_to_log(Path(sys.argv[1])) as terminal:
    print("python stdout noise")
    print("python stderr noise", file=sys.stderr)
    subprocess.run([sys.executable, "-c", "import os; os.write(1, b'child stdout noise\\n'); "
                    "os.write(2, b'child stderr noise\\n')"], check=True)
    logging.getLogger("vllm.fake").info("engine info line")
    print("stage line", file=terminal)
assert logging.getLogger().handlers == handlers
print("after")
"""


def test_output_to_log_sends_engine_writes_to_the_file_not_the_terminal(tmp_path):
    log_file = tmp_path / "sub" / "demo.log"
    child = subprocess.run([sys.executable, "-c", REDIRECT_SCRIPT, str(log_file)],
                           capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stderr
    assert (child.stdout, child.stderr) == ("after\n", "stage line\n")
    log = log_file.read_text()
    for text in ("python stdout noise", "python stderr noise", "child stdout noise", "child stderr noise",
                 "INFO vllm.fake: engine info line"):
        assert text in log


def test_json_result_keeps_the_two_row_keys_and_adds_the_rows():
    import argparse
    import json

    args = argparse.Namespace(prompts="mtbench", max_tokens=64, batch_size=1, temperature=0.0)
    rows = [dict(row, outputs=[[1, 2]] * 4) for row in ROWS]
    rows[2]["outputs"] = [[1, 2]] * 3 + [[1, 3]]
    result = json.loads(json.dumps(demo._result(args, "M", "H", True, 4, ["p"] * 4, rows)))
    assert result["rows"][1]["speedup"] == 61.5 / 50.0 and "outputs" not in result["rows"][1]
    assert [r["identical_outputs"] for r in result["rows"]] == [4, 4, 3]
    assert result["best"] == "specplug"
    assert (result["tok_per_s_without"], result["tok_per_s_with"], result["tau"]) == (50.0, 61.5, 1.31)
    assert result["identical_outputs"] == 4 and result["num_outputs"] == 4
