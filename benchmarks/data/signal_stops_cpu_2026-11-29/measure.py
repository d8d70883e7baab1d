"""Time a launcher stop: send SIGTERM/SIGINT after step 3's line; report steps after the
signal and launcher exit time after the last step line."""
import re, signal, sys, time, json
sys.path.insert(0, "tests/support")
from job_control import Job, launcher_cmd
QUICK = ["--hidden-size", "64", "--seq-length", "64", "--num-microbatches", "4",
         "--lr-warmup-iters", "2"]
sig = getattr(signal, sys.argv[1]) if len(sys.argv) > 1 else signal.SIGTERM
job = Job(launcher_cmd("--nproc", "2", *QUICK, "--train-iters", "1000"))
assert job.wait_for_line("step    3/", 240), job.text("err")
sent = time.monotonic()
job.proc.send_signal(sig)
code = job.finish(90)
ended = time.monotonic()
steps = [(t, int(m.group(1))) for t, n, l in job.seen
         if (m := re.match(r"^step\s+(\d+)/", l))]
before = [s for t, s in steps if t <= sent]
after = [(t, s) for t, s in steps if t > sent]
last_t = after[-1][0] if after else sent
print(json.dumps({"signal": sig.name, "status": code, "step_at_signal": before[-1],
                  "steps_after_signal": len(after), "last_step_s_after_signal": round(last_t - sent, 2),
                  "launcher_exit_s_after_last_step": round(ended - 0.3 - last_t, 2),
                  "launcher_exit_s_after_signal": round(ended - 0.3 - sent, 2)}))
print("\n".join(l for t, n, l in job.seen if n == "err" or "stopped" in l)[-2000:])
