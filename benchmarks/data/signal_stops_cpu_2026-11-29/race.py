"""SIGINT to the launcher the moment both rank processes exist (their interpreters starting)."""
import signal, sys, time
sys.path.insert(0, "tests/support")
from job_control import Job, launcher_cmd, rank_pid
QUICK = ["--hidden-size", "64", "--seq-length", "64", "--num-microbatches", "4", "--lr-warmup-iters", "2"]
for i in range(int(sys.argv[1])):
    job = Job(launcher_cmd("--nproc", "2", *QUICK, "--train-iters", "100"))
    while not all(rank_pid(job.proc.pid, r) for r in (0, 1)): time.sleep(0.01)
    job.proc.send_signal(signal.SIGINT); code = job.finish(60)
    lines = [l for _, _, l in job.seen if "torchrun --standalone" not in l]
    print(code, len(lines), lines[:2])
