"""`specplug soak`: real servers on loopback under mixed concurrent load, then checks.

For each configuration one server (vLLM's `specplug serve` with an EAGLE-3 head whose
`specplug` section selects stage chain / tree / adaptive, or SGLang's launch_server
with `--speculative-algorithm MEDUSA` or `RETRIEVAL`) is driven by N client threads for a bounded
time with a mix of OpenAI requests (see MIX), while a small KV cache forces
preemption and long prompts cross chunked prefill. A server with the same arguments
and no speculation answers a fixed greedy set first; the checks (CHECKS) are then
printed as a markdown table and written as JSON. Servers listen on 127.0.0.1 only.
When run from the repository on a CPU SGLang needs tests/support/sglang_path (test
stand-ins for sgl_kernel and torchvision, see docs/sglang.md): the harness puts it on
the SGLang server's PYTHONPATH when that folder exists and says so on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HOST = "127.0.0.1"  # never any other address
ROOT = Path(__file__).resolve().parents[1]
STAND_INS = ROOT / "tests" / "support" / "sglang_path"
NEAR_TIE_GAP = 5e-3  # nats: a greedy divergence is tolerated only where the baseline's top-2 gap is below this
RSS_GROWTH_LIMIT = 0.05
RSS_EVERY_S = 2  # seconds between RSS samples
CHECKS = ("no_errors", "all_complete", "greedy_lossless", "seeded_reproducible", "rss_stable", "healthy_after")
WORDS = ("the river city night model token tree draft verify cache layer head sample bonus accept "
         "reject kernel batch prefill decode stream server client request python function").split()
PROMPTS = ["The capital of France is", "Write a short poem about the sea.", "def fibonacci(n):",
           "List three colours:", "Explain speculative decoding in one sentence.", "1, 2, 3, 4,",
           "Once upon a time, in a small village,", "Translate to French: good morning, my friend."]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def long_prompt(rng: random.Random, words: int) -> str:
    return "Summarise this text. " + " ".join(rng.choice(WORDS) for _ in range(words))


# ---- the request mix: (name, path, job flags, body without prompt/messages); seed None = random

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
MIX = [
    ("greedy", COMPLETIONS, {"greedy": True}, dict(max_tokens=24, temperature=0, logprobs=2, ignore_eos=True)),
    ("seeded", COMPLETIONS, {"twice": True}, dict(max_tokens=16, temperature=0.8, top_p=0.9, seed=None,
                                                   ignore_eos=True)),
    ("penalised-stream", COMPLETIONS, {"stream": True}, dict(
        max_tokens=20, temperature=0.7, top_k=20, min_p=0.05, presence_penalty=0.5, frequency_penalty=0.3,
        repetition_penalty=1.1, ignore_eos=True)),
    ("stop", COMPLETIONS, {}, dict(max_tokens=32, temperature=0, stop=[".", "\n"])),
    ("n2", COMPLETIONS, {}, dict(max_tokens=12, temperature=1.0, n=2, ignore_eos=True)),
    ("chat-logprobs", CHAT, {}, dict(max_tokens=16, temperature=0.5, top_k=40, logprobs=True, top_logprobs=2,
                                     ignore_eos=True)),
    ("chat-stream", CHAT, {"stream": True}, dict(max_tokens=16, temperature=0)),
    ("json-schema", CHAT, {"json": True}, dict(max_tokens=48, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})),
    ("disconnect", COMPLETIONS, {"stream": True, "disconnect_after": 3}, dict(
        max_tokens=64, temperature=0.7, ignore_eos=True)),
    ("long", COMPLETIONS, {"long": True}, dict(max_tokens=128, temperature=0, ignore_eos=True)),  # grows the KV
]


def make_job(kind: int, rng: random.Random, args, prompt: int | None = None) -> dict:
    mix = [m for m in MIX if m[0] not in getattr(args, "skip", ())]
    name, path, flags, body = mix[kind % len(mix)]
    job = dict(flags, kind=name, path=path, body=dict(body))
    if job["body"].get("seed", 0) is None:
        job["body"]["seed"] = rng.randrange(1 << 20)
    prompt = rng.randrange(len(PROMPTS)) if prompt is None else prompt
    text = long_prompt(rng, args.long_prompt_words) if job.get("long") else PROMPTS[prompt]
    if job.get("json"):
        text = "Give a person's name and age as JSON."
    job["body"].update(prompt=text) if path == COMPLETIONS else job["body"].update(
        messages=[{"role": "user", "content": text}])
    if job.get("greedy"):
        job["greedy"] = prompt
    return job


# ---- one request: send it, then list what is wrong with the reply

def send(session, url: str, model: str, job: dict, timeout: float) -> dict:
    body = dict(job["body"], model=model)
    if job.get("stream"):
        body.update(stream=True, stream_options={"include_usage": True})
    try:
        reply = session.post(url + job["path"], json=body, timeout=timeout, stream=bool(job.get("stream")))
        if reply.status_code != 200:
            return {"problem": f"HTTP {reply.status_code}: {reply.text[:200]}"}
        return _read_stream(reply, job) if job.get("stream") else reply.json()
    except Exception as exc:  # noqa: BLE001 - every client-side failure is a finding
        return {"problem": f"connection error: {type(exc).__name__}: {str(exc)[:200]}"}


def _read_stream(reply, job: dict) -> dict:
    """Joins SSE chunks into {"choices": [{"text", "finish_reason"}], "usage"}; closes early
    for a deliberate disconnect (then {"aborted": True})."""
    text, finish, usage, chunks = "", None, None, 0
    for line in reply.iter_lines():
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        chunks += 1
        if job.get("disconnect_after") and chunks >= job["disconnect_after"]:
            reply.close()
            return {"aborted": True}
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices") or []:
            text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            finish = choice.get("finish_reason") or finish
    return {"choices": [{"text": text, "finish_reason": finish}], "usage": usage}


def problems(job: dict, reply: dict) -> list[str]:
    if "problem" in reply:
        return [reply["problem"]]
    body, out = job["body"], []
    choices, usage = reply.get("choices") or [], reply.get("usage") or {}
    if len(choices) != body.get("n", 1):
        out.append(f"{len(choices)} choices for n={body.get('n', 1)}")
    finishes = [c.get("finish_reason") for c in choices]
    if any(f not in ("length", "stop") for f in finishes):
        out.append(f"finish_reason {finishes}")
    tokens, asked = usage.get("completion_tokens"), body["max_tokens"] * body.get("n", 1)
    if body.get("ignore_eos") and not body.get("stop") and (tokens != asked or set(finishes) != {"length"}):
        out.append(f"{tokens} completion tokens ({finishes}) where {asked} were asked")
    elif tokens is None or tokens > asked:
        out.append(f"completion tokens {tokens} for max_tokens {asked}")
    if job.get("json") and finishes == ["stop"]:
        try:
            value = json.loads(choices[0]["message"]["content"])
            assert isinstance(value, dict) and set(SCHEMA["required"]) <= set(value)
        except Exception:  # noqa: BLE001
            out.append(f"not JSON of the schema: {choices[0]['message']['content'][:120]!r}")
    return [f"{job['path']} {p}" for p in out]


def text_of(reply: dict) -> list[str]:
    return [c.get("text") or (c.get("message") or {}).get("content") for c in reply.get("choices") or []]


# ---- greedy identity against the server without speculation

def tokens_and_gaps(reply: dict) -> tuple[list[str], list[float]]:
    logprobs = reply["choices"][0]["logprobs"]
    gaps = [(lambda v: v[0] - v[1] if len(v) > 1 else float("inf"))(sorted((top or {}).values(), reverse=True))
            for top in logprobs["top_logprobs"]]
    return logprobs["tokens"], gaps


def greedy_problem(reply: dict, base: dict) -> str | None:
    """None if `reply` equals the baseline, or first diverges where the baseline's top-2 gap < NEAR_TIE_GAP."""
    (spec, _), (ref, gaps) = tokens_and_gaps(reply), tokens_and_gaps(base)
    if spec == ref:
        return None
    i = next((i for i, (a, b) in enumerate(zip(spec, ref)) if a != b), min(len(spec), len(ref)))
    if i < len(gaps) and gaps[i] < NEAR_TIE_GAP:
        return "near-tie"
    return f"greedy prompt diverges at token {i} (baseline gap {gaps[i] if i < len(gaps) else 'n/a'}): " \
           f"{''.join(spec)!r} vs {''.join(ref)!r}"


def greedy_set(url: str, model: str, timeout: float) -> list[dict]:
    """The greedy prompts' answers in prompt order, all sent at once (a batch of 8; one at a
    time, the set took 22 s on the server without speculation and 42 s on MEDUSA's)."""
    import requests
    from concurrent.futures import ThreadPoolExecutor

    def answer(i: int) -> dict:
        with requests.Session() as session:
            return send(session, url, model, make_job(0, random.Random(i), None, i), timeout)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(answer, range(len(PROMPTS))))


# ---- load: N client threads until the deadline (and at most max_requests each)

class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.completed = self.aborted = self.greedy = self.near_ties = self.seeded_pairs = 0
        self.errors: list[str] = []
        self.greedy_failures: list[str] = []
        self.seeded_failures: list[str] = []


def client(index: int, url: str, model: str, args, deadline: float, baseline: list[dict], tally: Tally):
    import requests

    rng = random.Random(index)
    with requests.Session() as session:
        for n in range(args.max_requests_per_client):
            if time.monotonic() >= deadline:
                return
            job = make_job(index + n, rng, args)
            reply = send(session, url, model, job, args.request_timeout)
            again = send(session, url, model, job, args.request_timeout) if job.get("twice") else None
            record(job, reply, again, baseline, tally)


def record(job, reply, again, baseline, tally: Tally) -> None:
    found = problems(job, reply) + (problems(job, again) if again else [])
    with tally.lock:
        if reply.get("aborted"):
            tally.aborted += 1
            return
        tally.errors += found
        if found:
            return
        tally.completed += 1 + (again is not None)
        if "greedy" in job:
            tally.greedy += 1
            verdict = greedy_problem(reply, baseline[job["greedy"]])
            tally.near_ties += verdict == "near-tie"
            tally.greedy_failures += [verdict] if verdict not in (None, "near-tie") else []
        if again is not None:
            tally.seeded_pairs += 1
            if text_of(reply) != text_of(again):
                tally.seeded_failures.append(f"seed {job['body']['seed']}: {text_of(reply)} vs {text_of(again)}")


def rss_bytes(pid: int) -> int:
    import psutil

    proc = psutil.Process(pid)
    total = proc.memory_info().rss
    for child in proc.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def drive(server: dict, args, baseline: list[dict]) -> dict:
    """Runs the load; samples the server tree's RSS every few seconds; returns tally + RSS."""
    from tqdm import tqdm

    tally, seconds = Tally(), args.minutes * 60
    start = time.monotonic()
    threads = [threading.Thread(target=client, daemon=True, args=(
        i, server["url"], args.model, args, start + seconds, baseline, tally)) for i in range(args.clients)]
    for t in threads:
        t.start()
    samples, bar = [], tqdm(total=int(seconds), unit="s", file=sys.stderr, desc=server["name"])
    while any(t.is_alive() for t in threads):
        samples.append((time.monotonic() - start, rss_bytes(server["proc"].pid)))
        bar.n = min(int(samples[-1][0]), int(seconds))
        bar.set_postfix(done=tally.completed, aborted=tally.aborted, errors=len(tally.errors),
                        rss_mib=samples[-1][1] >> 20)
        time.sleep(RSS_EVERY_S)
    bar.close()
    samples.append((time.monotonic() - start, rss_bytes(server["proc"].pid)))
    return {"tally": tally, "seconds": samples[-1][0], **rss_summary(samples, seconds)}


def warm_up_end(seconds: float) -> float:
    """When the RSS check's reference window ends: after the first third of the run, while
    caches fill (the retrieval drafter's recent requests, vLLM's and torch's allocators;
    measured: 5-13 minutes, then flat), and at least at the end of minute 1 (two thirds of
    runs shorter than 90 s, whose check only guards against a gross leak)."""
    return max(min(60.0, seconds * 2 / 3), seconds / 3)


def rss_summary(samples: list[tuple[float, int]], seconds: float) -> dict:
    """RSS at minute 1, the warm-up's high-water mark and the end (MiB); rss_growth (the check)
    is end against the warm-up's high-water mark, rss_growth_min1 end against minute 1
    (reported). The high-water mark, not the last warm-up sample: the RSS swings a few per cent
    with the mix in flight (CI, a 30 s run: 2644 MiB at 5 s, 2638 at 10 s, 2834 at 15 s,
    2695 at 25 s, 2840 from 30 s to the end)."""
    def by(t_max):  # the samples taken by t_max
        return [r for t, r in samples if t <= t_max]

    first, ref, end = by(min(60.0, seconds / 2))[-1], max(by(warm_up_end(seconds))), samples[-1][1]
    return {"rss_first_mib": first / 2**20, "rss_ref_mib": ref / 2**20, "rss_end_mib": end / 2**20,
            "rss_growth": end / ref - 1, "rss_growth_min1": end / first - 1}


# ---- servers

def server_command(args, port: int, config: str | None) -> tuple[list[str], dict]:
    env = dict(os.environ)
    if args.engine == "vllm":
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override --kv-cache-memory-bytes
        cmd = [sys.executable, "-m", "specplug.cli", "serve", args.model, "--host", HOST, "--port", str(port),
               "--dtype", "float32", "--enforce-eager", "--seed", "0", "--max-model-len", str(args.max_model_len),
               "--max-num-batched-tokens", str(args.max_num_batched_tokens),
               "--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes)]
        return cmd + (["--speculative-config", json.dumps(vllm_spec(args, config))] if config else []), env
    if STAND_INS.is_dir():
        print(f"soak: SGLang server gets test stand-ins on PYTHONPATH: {STAND_INS}", file=sys.stderr)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(STAND_INS), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", args.model, "--host", HOST,
           "--port", str(port), "--device", "cpu", "--dtype", "float32", "--attention-backend", "torch_native",
           "--disable-cuda-graph", "--mem-fraction-static", "0.5", "--max-total-tokens", str(args.max_total_tokens),
           "--chunked-prefill-size", str(args.max_num_batched_tokens), "--context-length", str(args.max_model_len),
           "--random-seed", "0", "--log-level", "warning", "--sleep-on-idle"]  # else an idle scheduler spins a core
    spec = {"medusa": ["--speculative-algorithm", "MEDUSA", "--speculative-draft-model-path", args.head],
            "retrieval": ["--speculative-algorithm", "RETRIEVAL"]}
    return cmd + spec.get(config, []), env


def vllm_spec(args, config: str) -> dict:
    """The --speculative-config of a vLLM config: the EAGLE-3 head (`--head`) in stage chain,
    tree or adaptive, or specplug's Medusa tree on the Medusa heads (`--medusa-head`,
    converted to vLLM's format once)."""
    from specplug.vllm_eagle3.bench_runner import _head_copy, head_settings, staged_head, vllm_medusa_head

    if config == "medusa":
        from specplug.vllm_eagle3.medusa_settings import tree_nodes

        head = staged_head(vllm_medusa_head(args.medusa_head, args.model), "tree")
        return {"method": "medusa", "model": head, "num_speculative_tokens": tree_nodes(head)}
    tree = head_settings(args.head).tree
    edits = {"chain": dict(stage="chain"), "tree": dict(stage="tree"), "adaptive": dict(stage="chain", adaptive=True)}
    copy = _head_copy(args.head, f"specplug-soak-{config}-",
                      lambda c: c.setdefault("specplug", {}).update(edits[config]))
    return {"method": "eagle3", "model": copy,
            "num_speculative_tokens": tree.budget if config == "tree" else tree.depth}


def launch_server(args, name: str, config: str | None) -> dict:
    """Starts a server process on a free loopback port; `wait_healthy` waits for it."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        port = s.getsockname()[1]
    cmd, env = server_command(args, port, config)
    log = Path(args.log_dir) / f"soak-{args.engine}-{name}.log"
    print(f"soak: starting {name} on {HOST}:{port}; log {log}", file=sys.stderr)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return {"name": name, "url": f"http://{HOST}:{port}", "proc": proc, "log": log,
            "deadline": time.monotonic() + args.startup_timeout}


def wait_healthy(server: dict) -> dict:
    """Returns `server` once /health answers 200; stops it and raises if it exits or times out."""
    import requests

    proc = server["proc"]
    while proc.poll() is None:  # asked at least once: a server launched early may be past its deadline
        try:
            if requests.get(server["url"] + "/health", timeout=5).status_code == 200:
                return server
        except requests.RequestException:
            pass
        if time.monotonic() >= server["deadline"]:
            break
        time.sleep(2)
    stop_server(server)
    raise RuntimeError(f"server {server['name']} did not become healthy (exit {proc.returncode}); "
                       f"see {server['log']}:\n" + server["log"].read_text()[-3000:])


def start_server(args, name: str, config: str | None) -> dict:
    return wait_healthy(launch_server(args, name, config))


def stop_server(server: dict) -> None:
    proc = server["proc"]
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # the server shuts its engine processes down itself
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def preemptions(server: dict, engine: str) -> int:
    """vLLM: the vllm:num_preemptions counter; SGLang: '#retracted_reqs: N' warnings in its log."""
    import requests

    if engine == "sglang":
        return sum(int(n) for n in re.findall(r"#retracted_reqs: (\d+)", server["log"].read_text()))
    text = requests.get(server["url"] + "/metrics", timeout=10).text
    return int(sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("vllm:num_preemptions_total")))


# ---- one configuration, the report, the command

def soak_config(args, config: str, baseline: list[dict], server: dict | None = None) -> dict:
    """Soaks `server` (default: a new one for `config`, stopped afterwards)."""
    import requests

    server = server or start_server(args, config, config)
    try:
        quiet = [greedy_problem(r, b) if "problem" not in r else r["problem"]
                 for r, b in zip(greedy_set(server["url"], args.model, args.request_timeout), baseline)]
        load = drive(server, args, baseline)
        try:
            healthy = requests.get(server["url"] + "/health", timeout=10).status_code == 200
            preempted = preemptions(server, args.engine)
        except requests.RequestException as exc:
            print(f"soak: {config} server is gone after the load ({exc}); see {server['log']}", file=sys.stderr)
            healthy, preempted = False, None
    finally:
        if config != "none":
            stop_server(server)
    t = load["tally"]
    greedy_failures = [q for q in quiet if q not in (None, "near-tie")] + t.greedy_failures
    result = {"config": config, "clients": args.clients, "minutes": round(load["seconds"] / 60, 2),
              "completed": t.completed, "aborted": t.aborted, "errors": len(t.errors), "preemptions": preempted,
              "greedy_checked": len(quiet) + t.greedy, "greedy_near_ties": t.near_ties + quiet.count("near-tie"),
              "seeded_pairs": t.seeded_pairs, "seeded_mismatched": len(t.seeded_failures),
              "rss_first_mib": round(load["rss_first_mib"]), "rss_ref_mib": round(load["rss_ref_mib"]),
              "rss_end_mib": round(load["rss_end_mib"]), "rss_growth": round(load["rss_growth"], 4),
              "rss_growth_min1": round(load["rss_growth_min1"], 4),
              "first_errors": t.errors[:10], "greedy_failures": greedy_failures[:10],
              "seeded_failures": t.seeded_failures[:10], "log": str(server["log"])}
    result["checks"] = {"no_errors": not t.errors, "all_complete": not t.errors and t.completed > 0,
                        "greedy_lossless": not greedy_failures, "seeded_reproducible": not t.seeded_failures,
                        "rss_stable": load["rss_growth"] < RSS_GROWTH_LIMIT, "healthy_after": healthy}
    return result


def table(results: list[dict], args) -> str:
    head = ["config", "clients", "minutes", "completed", "aborted", "errors", "preemptions", "greedy (near-ties)",
            "seeded pairs (differing)", "RSS MiB (min 1 / warm-up high -> end)", "failed checks"]
    rows = [[r["config"], r["clients"], r["minutes"], r["completed"], r["aborted"], r["errors"], r["preemptions"],
             f"{r['greedy_checked']} ({r['greedy_near_ties']})", f"{r['seeded_pairs']} ({r['seeded_mismatched']})",
             f"{r['rss_first_mib']} / {r['rss_ref_mib']} -> {r['rss_end_mib']} ({r['rss_growth']:+.1%})",
             ", ".join(k for k, ok in r["checks"].items() if not ok) or "none"] for r in results]
    medusa = f", Medusa heads {args.medusa_head}" if args.engine == "vllm" and "medusa" in args.configs else ""
    lines = [f"specplug soak: engine {args.engine}, model {args.model}, head {args.head}{medusa}",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(map(str, row)) + " |" for row in rows])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", choices=["vllm", "sglang"], default="vllm", help="server to soak")
    parser.add_argument("--configs", default=None, help="comma-separated: chain,tree,adaptive,medusa for vllm "
                        "(EAGLE-3 stage chain K=depth / stage tree K=budget / adaptive; specplug's Medusa tree "
                        "on --medusa-head), medusa,retrieval for sglang; "
                        "none = the same load on the server without speculation (a control); "
                        "None = all of the engine's except none")
    parser.add_argument("--model", default=None, help="target model folder; None = the test-bed target")
    parser.add_argument("--head", default=None, help="EAGLE-3 head (vllm) or Medusa heads folder (sglang); "
                        "None = the test bed's smollm2-eagle3 / smollm2-medusa")
    parser.add_argument("--medusa-head", default="testbed", help="Medusa heads for vllm's medusa config "
                        "(converted to vLLM's format when needed); testbed = the test bed's smollm2-medusa")
    parser.add_argument("--clients", type=int, default=64, help="concurrent client threads")
    parser.add_argument("--minutes", type=float, default=5.0, help="load time per configuration")
    parser.add_argument("--max-requests-per-client", type=int, default=1000, help="bound on each client's loop")
    parser.add_argument("--request-timeout", type=float, default=900.0, help="seconds per HTTP request")
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds for a server to get healthy")
    parser.add_argument("--long-prompt-words", type=int, default=1500,
                        help="words in the long prompts (about a token each on the test bed: crosses chunked prefill)")
    parser.add_argument("--max-model-len", type=int, default=2560, help="context length of the servers")
    parser.add_argument("--max-num-batched-tokens", type=int, default=256,
                        help="prefill chunk (vllm --max-num-batched-tokens, sglang --chunked-prefill-size)")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=128 << 20,
                        help="vllm KV cache (small: forces preemption)")
    parser.add_argument("--max-total-tokens", type=int, default=4096,
                        help="sglang KV cache in tokens (small: forces retraction)")
    parser.add_argument("--skip", default="", help="comma-separated request kinds to leave out of the mix: "
                        + ",".join(m[0] for m in MIX))
    parser.add_argument("--log-dir", default=None, help="folder for the server logs; None = a new temporary folder")
    parser.add_argument("--json", default=None, help="write the results to this file as JSON")


def defaults(args) -> None:
    from specplug.common import testbed

    args.model = str(args.model or testbed.target_dir())
    name = "smollm2-eagle3" if args.engine == "vllm" else "smollm2-medusa"
    args.head = str(args.head or testbed.head_dir(name))
    default_configs = "chain,tree,adaptive,medusa" if args.engine == "vllm" else "medusa,retrieval"
    args.configs = (args.configs or default_configs).split(",")
    allowed = {"vllm": {"none", "chain", "tree", "adaptive", "medusa"},
               "sglang": {"none", "medusa", "retrieval"}}[args.engine]
    if not set(args.configs) <= allowed:
        raise ValueError(f"--configs {','.join(args.configs)} is not valid for --engine {args.engine}: "
                         f"choose from {','.join(sorted(allowed))}")
    args.skip = [k for k in args.skip.split(",") if k]
    if not set(args.skip) < {m[0] for m in MIX}:
        raise ValueError(f"--skip {','.join(args.skip)}: expected some of {','.join(m[0] for m in MIX)}")
    args.log_dir = args.log_dir or tempfile.mkdtemp(prefix="specplug-soak-")
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)  # --log-dir need not exist yet


def baseline_and_control(args, base: dict) -> tuple[list[dict] | None, list[dict]]:
    """The greedy set's answers from the server without speculation (None if any failed),
    and the control soak of that server when "none" is among the configs."""
    baseline = greedy_set(wait_healthy(base)["url"], args.model, args.request_timeout)
    if any("problem" in b for b in baseline):
        print(f"soak: the server without speculation failed the greedy set: {baseline}", file=sys.stderr)
        return None, []
    return baseline, [soak_config(args, "none", baseline, base)] if "none" in args.configs else []


def run(args: argparse.Namespace) -> int:
    defaults(args)
    configs = [config for config in args.configs if config != "none"]
    base = launch_server(args, "none", None)
    # The first speculative server starts beside the baseline: their start-ups overlap, and an
    # idle engine waits on its socket (SGLang with --sleep-on-idle; without it, its idle
    # scheduler spun a core and took the baseline's greedy set from ~35 s to 2.6 minutes on 2
    # cores). Not with a control run, which soaks the baseline itself.
    overlap = bool(configs) and "none" not in args.configs
    first = launch_server(args, configs[0], configs[0]) if overlap else None
    baseline = None
    try:
        baseline, control = baseline_and_control(args, base)
    finally:
        stop_server(base)
        if first and baseline is None:
            stop_server(first)
    if baseline is None:
        return 1
    results = control + [soak_config(args, config, baseline, wait_healthy(first) if i == 0 and first else None)
                         for i, config in enumerate(configs)]
    print(table(results, args))
    for r in results:
        for key in ("first_errors", "greedy_failures", "seeded_failures"):
            for line in r[key]:
                print(f"soak {r['config']} {key}: {line}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps({"engine": args.engine, "model": args.model, "head": args.head,
                                               "results": results}, indent=2))
    return int(not all(all(r["checks"].values()) for r in results))
