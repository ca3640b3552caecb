"""Tokens/s with and without the draft (1 and 4 streams), acceptance length, start-up time and peak RSS of the
real-width pair (`real-width-cpu`) and of the tiny pair (`tiny-cpu`), one server at a time, with the project's
own tools: `kimi-eagle serve` for each server, `kimi-eagle loadtest` against it. Both pairs at a fixed k = 4
(`-k 4`, KIMI_EAGLE_MEASURED_K=0: no schedule, no measured k), greedy, 64 output tokens, completion-short prompts.

Run from the repository root under the heavy lock (see reproduce.sh); writes results.json beside this file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import requests

HERE = Path(__file__).resolve().parent
PORT = 8391
URL = f"http://127.0.0.1:{PORT}"
RUN_TIME = {"real-width-cpu": "120s", "tiny-cpu": "40s"}


class PeakRss(threading.Thread):
    """The largest RSS of the server's process tree (kimi-eagle serve, vLLM's API server, its engine core)."""

    def __init__(self, root: psutil.Process) -> None:
        super().__init__(daemon=True)
        self.root, self.peak, self.done = root, 0, False

    def run(self) -> None:
        while not self.done:
            try:
                total = sum(p.memory_info().rss for p in [self.root, *self.root.children(recursive=True)])
                self.peak = max(self.peak, total)
            except psutil.Error:
                pass
            time.sleep(0.5)


def measure(profile: str, draft: bool, out: Path) -> dict:
    argv = [sys.executable, "-m", "kimi_eagle.cli", "serve", profile, "--port", str(PORT), "--ready-timeout", "1500"]
    argv += ["-k", "4"] if draft else ["--no-draft"]
    env = {**os.environ, "KIMI_EAGLE_MEASURED_K": "0"}
    log = open(out / "server.log", "w")  # noqa: SIM115 - the server's
    started = time.monotonic()
    server = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    rss = PeakRss(psutil.Process(server.pid))
    rss.start()
    try:
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"{profile} exited before it was ready: {out / 'server.log'}")
            try:
                if requests.get(f"{URL}/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(0.5)
        ready_s = time.monotonic() - started
        rss_ready = rss.peak
        subprocess.run([sys.executable, "-m", "kimi_eagle.cli", "loadtest", "--url", URL, "--users", "1,4",
                        "--max-tokens", "64", "--run-time", RUN_TIME[profile], "--prompts", "completion-short",
                        "--out", str(out / "loadtest"), "--label", f"{profile} {'draft' if draft else 'no draft'}"],
                       check=True)
    finally:
        server.send_signal(2)
        try:
            server.wait(120)
        except subprocess.TimeoutExpired:
            server.kill()
        rss.done = True
    points = {}
    for summary in sorted((out / "loadtest").rglob("summary.json")):
        s = json.loads(summary.read_text())
        if not s.get("locust"):
            continue  # the sweep's own summary, beside one per point
        users = s["locust"]["users"]
        acc = s.get("acceptance") or {}
        points[str(users)] = {"output_tokens_per_s": s["throughput"]["output_tokens_per_s"],
                              "mean_acceptance_length": acc.get("mean_acceptance_length"),
                              "acceptance_rate": acc.get("acceptance_rate"), "summary": str(summary.relative_to(HERE))}
    return {"profile": profile, "draft": draft, "ready_s": round(ready_s, 1),
            "peak_rss_gib_at_ready": round(rss_ready / 2**30, 2), "peak_rss_gib": round(rss.peak / 2**30, 2),
            "points": points}


def render(runs: list[dict]) -> str:
    """README.md: the figures side by side, and real width over tiny as a ratio."""
    by = {(r["profile"], r["draft"]): r for r in runs}

    def tps(profile: str, draft: bool, users: str) -> float | None:
        point = by.get((profile, draft), {}).get("points", {}).get(users)
        return point and point["output_tokens_per_s"]

    def acc(profile: str, users: str) -> float | None:
        point = by.get((profile, True), {}).get("points", {}).get(users)
        return point and point["mean_acceptance_length"]

    def f(x: float | None, digits: int = 2) -> str:
        return "-" if x is None else f"{x:.{digits}f}"

    def ratio(a: float | None, b: float | None) -> str:
        return "-" if not a or not b else f"{a / b:.3g}"

    rows = ["| figure | real-width-cpu | tiny-cpu | real / tiny |", "|---|---|---|---|"]
    for users in ("1", "4"):
        for draft in (True, False):
            name = f"output tok/s, {users} stream{'s' if users != '1' else ''}, {'with' if draft else 'without'} draft"
            a, b = tps("real-width-cpu", draft, users), tps("tiny-cpu", draft, users)
            rows.append(f"| {name} | {f(a)} | {f(b)} | {ratio(a, b)} |")
        a = tps("real-width-cpu", True, users), tps("real-width-cpu", False, users)
        b = tps("tiny-cpu", True, users), tps("tiny-cpu", False, users)
        sa, sb = (x[0] / x[1] if x[0] and x[1] else None for x in (a, b))
        rows.append(f"| speed-up of the draft, {users} stream(s) | {ratio(sa, 1)}x | {ratio(sb, 1)}x | "
                    f"{ratio(sa, sb)} |")
        a, b = acc("real-width-cpu", users), acc("tiny-cpu", users)
        rows.append(f"| mean acceptance length, {users} stream(s) | {f(a)} | {f(b)} | {ratio(a, b)} |")
    for draft in (True, False):
        label = "with" if draft else "without"
        a, b = by.get(("real-width-cpu", draft), {}), by.get(("tiny-cpu", draft), {})
        rows.append(f"| start-up to Ready, {label} draft (s) | {f(a.get('ready_s'), 1)} | {f(b.get('ready_s'), 1)} | "
                    f"{ratio(a.get('ready_s'), b.get('ready_s'))} |")
        rows.append(f"| peak RSS, {label} draft (GiB) | {f(a.get('peak_rss_gib'))} | {f(b.get('peak_rss_gib'))} | "
                    f"{ratio(a.get('peak_rss_gib'), b.get('peak_rss_gib'))} |")
    return "\n".join(rows) + "\n"


def main() -> None:
    runs = []
    for profile in ("real-width-cpu", "tiny-cpu"):
        for draft in (True, False):
            out = HERE / f"{profile}-{'draft' if draft else 'plain'}"
            out.mkdir(parents=True, exist_ok=True)
            runs.append(measure(profile, draft, out))
            (HERE / "results.json").write_text(json.dumps({"runs": runs}, indent=2) + "\n")
            (HERE / "table.md").write_text(render(runs))
            print(json.dumps(runs[-1]), flush=True)


if __name__ == "__main__":
    main()
