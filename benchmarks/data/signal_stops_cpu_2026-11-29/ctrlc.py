"""Ctrl-C as a terminal sends it (SIGINT to the launcher's process group) `delay` s after start."""
import os, signal, subprocess, sys, time, json
sys.path.insert(0, "tests/support")
from job_control import job_env, launcher_cmd, REPO
QUICK = ["--hidden-size", "64", "--seq-length", "64", "--num-microbatches", "4", "--lr-warmup-iters", "2"]
out = []
for delay in map(float, sys.argv[1:]):
    p = subprocess.Popen(launcher_cmd("--nproc", "2", *QUICK, "--train-iters", "1000"), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=job_env(), cwd=REPO, start_new_session=True)
    time.sleep(delay)
    t = time.monotonic(); os.killpg(p.pid, signal.SIGINT)
    try:
        text, _ = p.communicate(timeout=40); took = time.monotonic() - t
    except subprocess.TimeoutExpired:
        from job_control import descendants
        kids = descendants(p.pid); p.kill()
        for pid in kids:
            try: os.kill(pid, 9)
            except ProcessLookupError: pass
        text, _ = p.communicate(); took = None
    lines = [l for l in text.splitlines() if not l.startswith("epoverlap-launch: 2 CPU")]
    print(json.dumps({"delay_s": delay, "status": p.returncode, "exit_s": round(took, 2), "lines": len(lines),
                      "stopped_lines": [l for l in lines if "stopped by" in l][:3], "code": os.path.basename(str(REPO)), "first_lines": lines[:4]}))
