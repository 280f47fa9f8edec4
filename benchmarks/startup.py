"""Start-up and the first answer of a fresh process (issue 59), each in fresh subprocesses.

    python -m benchmarks.startup            # the embedded SmolLM2, on this host as it is
    python -m benchmarks.startup --busy     # the same with 2 CPU-bound neighbour processes running

Prints, in one run:

* import + load (``import ragblend``, ``BlendEngine.from_pretrained()``) of a fresh process with
  an empty cache dir (``RAGBLEND_CACHE_DIR``: the GGUF's config and tokenizer, every start-up
  measurement and the kernel choice made again), and how long its kernel measurement then ran
  in the background;
* the same with that cache dir warm (``--loads`` processes, the median);
* a fresh process's first fused answer against its second (the sample question over four
  sample passages, then over them in reverse order: the same work, no repeated prompt; the
  passages' KV precomputed on disk, so the first reads disk as ``ragblend ask`` does),
  as the library runs it, after a one-token full prefill (``ragblend ask --compare``'s
  warm-up), and through a fresh ``ragblend serve`` with the openai client: TTFT and whole answer;
* the Streamlit app's fused answers (three sample questions, in Streamlit's own ``AppTest``
  runner: the app's code as a browser session runs it): the first follows the app's untimed
  warm-up on the same question, so the ratio is of the next two.

Targets (issue 59): warm import + load <= 5 s on a quiet host and <= 2x that with a
neighbour using both cores; first fused answer <= 1.3x the second.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LOAD = r"""
import json, sys, time
start = time.perf_counter()
import ragblend
imported = time.perf_counter()
engine = ragblend.BlendEngine.from_pretrained(kv_dir=False)
loaded = time.perf_counter()
plan = engine.kernel_plan
source = plan.source if plan is not None else "none"
settle = None
if plan is not None and plan.background is not None and sys.argv[1] == "settle":
    plan.background.join()   # the kernels measured in the background, cached for the next processes
    settle = time.perf_counter() - loaded
print(json.dumps({"import_s": imported - start, "load_s": loaded - imported, "kernels": source,
                  "settle_s": settle, "state": plan.state() if plan is not None else ""}))
"""

ANSWERS = r"""
import json, sys, time
import ragblend
from ragblend import Chunk, FullRecompute
from ragblend.data import load_sample
sample = load_sample()
chunks = sample["chunks"][:4]
engine = ragblend.BlendEngine.from_pretrained(kv_dir=sys.argv[1])
if sys.argv[2] == "setup":
    engine.precompute(chunks)
    engine.flush()
    sys.exit()
if sys.argv[2] == "compare":   # ragblend ask --compare's untimed warm-up, and its prefix tier kept out
    from ragblend.integrations.compare import fusion_only
    fusion_only().__enter__()   # for the rest of this process
    engine.generate([Chunk(c) for c in chunks] + [sample["question"]], strategy=FullRecompute(), max_new_tokens=1)
times = []
for order in (chunks, chunks[::-1]):   # the same work twice, but no repeat of the first prompt
    start = time.perf_counter()
    out = engine.generate([Chunk(c) for c in order] + [sample["question"]], max_new_tokens=16)
    times.append({"ttft_s": out.stats.ttft_s, "answer_s": time.perf_counter() - start,
                  "tiers": out.stats.tiers, "load_s": out.stats.load_s})
print(json.dumps(times))
"""


def server_answers(cache: str, kv: str) -> list[dict]:
    """A fresh ``ragblend serve`` process over the stored chunks: its first and second fused
    answers (two questions, chunks marked as the serving docs show), timed by the server's stats
    and by the official openai client (request to the whole reply)."""
    import socket

    from openai import OpenAI

    from ragblend.data import load_sample

    sample = load_sample()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "RAGBLEND_CACHE_DIR": cache, "PYTHONPATH": os.getcwd()}
    log = open(Path(kv).parent / "serve.log", "w+")   # a file: a pipe nobody reads could block the server
    server = subprocess.Popen([sys.executable, "-m", "ragblend.cli", "serve", "--port", str(port), "--kv-dir", kv],
                              env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=600)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                model = client.models.list().data[0].id
                break
            except Exception:
                if server.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise SystemExit(f"ragblend serve did not start:\n{log.read()[-3000:]}")
                time.sleep(0.5)
        times = []
        for order in (sample["chunks"][:4], sample["chunks"][:4][::-1]):   # as in ANSWERS
            content = []
            for chunk in order:
                content += [{"type": "text", "text": chunk, "cache_control": {"type": "ephemeral"}},
                            {"type": "text", "text": "\n\n"}]
            start = time.perf_counter()
            reply = client.chat.completions.create(
                model=model, max_tokens=16, temperature=0,
                messages=[{"role": "user", "content": content + [{"type": "text", "text": sample["question"]}]}])
            stats = reply.model_extra["ragblend"]
            times.append({"ttft_s": stats["ttft_s"], "answer_s": time.perf_counter() - start,
                          "tiers": stats.get("tiers"), "cached": reply.usage.prompt_tokens_details.cached_tokens})
        return times
    finally:
        server.terminate()
        try:
            server.wait(90)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


APP = r"""
import json
from pathlib import Path
from streamlit.testing.v1 import AppTest
from ragblend.data import load_sample
at = AppTest.from_file(str(Path.cwd() / "apps" / "streamlit_app.py"), default_timeout=900)
at.run()
button = lambda key: next(b for b in at.button if b.key == key)
at.checkbox[0].uncheck()   # the fused answer alone, as a user who turned the comparison off
# The app warms each path up (one untimed token) at its first question, on that question: so the
# timed answers are the next two, other questions (no prompt repeated). The first question's own
# answer is reported too (it follows the warm-up on the same prompt).
for question in load_sample()["demo"][:3]:
    at.text_input(key="question").input(question["question"])
    button("ask").click().run()
    assert not at.exception, at.exception
last = at.session_state["history"]
print(json.dumps([row["TTFT with fusion (s)"] for row in last]))
"""


def app_answers(cache: str, tmp: str) -> list[float]:
    """The Streamlit app (Streamlit's own AppTest runner, in a fresh process): its first and
    second fused answers' TTFT, over the sample documents ingested before (``ragblend ingest --kv now``)."""
    from ragblend.data import sample_dir

    env = {"RAGBLEND_INDEX_DIR": str(Path(tmp) / "app-index"), "RAGBLEND_FILES_ROOT": str(sample_dir())}
    index = env["RAGBLEND_INDEX_DIR"]
    out = subprocess.run([sys.executable, "-m", "ragblend.cli", "ingest", str(sample_dir()), "--index", index, "--kv",
                          "now"], capture_output=True, text=True, env={**os.environ, "RAGBLEND_CACHE_DIR": cache})
    if out.returncode != 0:
        raise SystemExit(f"ragblend ingest failed:\n{out.stderr[-3000:]}")
    return json.loads(child(APP, [], cache, env=env))


def ratio_line(label: str, first: dict, second: dict) -> str:
    return (f"first fused answer {label}: TTFT {first['ttft_s']:.2f} s / answer {first['answer_s']:.2f} s "
            f"({first['tiers']}); second {second['ttft_s']:.2f} s / {second['answer_s']:.2f} s ({second['tiers']}); "
            f"ratio TTFT {first['ttft_s'] / second['ttft_s']:.2f}x, answer {first['answer_s'] / second['answer_s']:.2f}x")


def child(code: str, args: list[str], cache: str, timeout: float = 1800, env: dict | None = None) -> str:
    env = {**os.environ, **(env or {}), "RAGBLEND_CACHE_DIR": cache, "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env,
                         timeout=timeout)
    if out.returncode != 0:
        raise SystemExit(f"a child process failed:\n{out.stderr[-3000:]}")
    lines = out.stdout.strip().splitlines()
    return lines[-1] if lines else ""


def neighbours(count: int) -> list[subprocess.Popen]:
    """``count`` processes that keep a core busy each until killed."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--busy", action="store_true", help="run 2 CPU-bound neighbour processes meanwhile")
    parser.add_argument("--loads", type=int, default=3, help="warm-cache loads to time (default 3; the median)")
    args = parser.parse_args(argv)
    from ragblend.core.model.kernels import cpu_summary

    print(f"Host: {cpu_summary()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
          f"load average before {os.getloadavg()[0]:.1f}{'; 2 CPU-bound neighbours' if args.busy else ''}", flush=True)
    busy = neighbours(2) if args.busy else []
    try:
        with tempfile.TemporaryDirectory(prefix="ragblend-startup-") as tmp:
            cache = str(Path(tmp) / "cache")
            empty = json.loads(child(LOAD, ["settle"], cache))
            print(f"empty cache: import {empty['import_s']:.2f} s + load {empty['load_s']:.2f} s "
                  f"(kernels: {empty['kernels']}; measured in the background in {empty['settle_s'] or 0:.1f} s "
                  f"after the load)", flush=True)
            warm = [json.loads(child(LOAD, ["no"], cache)) for _ in range(args.loads)]
            total = statistics.median(w["import_s"] + w["load_s"] for w in warm)
            print(f"warm cache ({args.loads} processes): import + load median {total:.2f} s "
                  f"(import {statistics.median(w['import_s'] for w in warm):.2f} s, load "
                  f"{statistics.median(w['load_s'] for w in warm):.2f} s; kernels {warm[-1]['kernels']}: "
                  f"{warm[-1]['state']})", flush=True)
            kv = str(Path(tmp) / "kv")
            child(ANSWERS, [kv, "setup"], cache)
            for mode in ("plain", "compare"):
                first, second = json.loads(child(ANSWERS, [kv, mode], cache))
                label = "as the library runs it" if mode == "plain" else "after a 1-token full prefill (--compare)"
                print(ratio_line(label, first, second), flush=True)
            first, second = server_answers(cache, kv)
            print(ratio_line("of a fresh `ragblend serve` (openai client)", first, second), flush=True)
            warmed, first, second = app_answers(cache, tmp)
            print(f"Streamlit app (a fresh process): the question it warmed up on {warmed:.2f} s; then the first "
                  f"other question TTFT {first:.2f} s, the second {second:.2f} s; ratio {first / second:.2f}x", flush=True)
    finally:
        for process in busy:
            process.kill()
            process.wait()
    print(f"load average after {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
