# session 69, call 4 (nvidia-h200): the grads' GPU tests, the host transport's bench test, the Qwen3 peer recipe, bench_main_grad_ops
export PYTHONUNBUFFERED=1
pip install -q --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1
timeout 150 python -m pytest -v -p no:cacheprovider -m gpu tests/kernels/test_main_grad_ops.py tests/training/test_grad_placement.py tests/benchmarks/test_bench_contention.py -k "main_grad or placement or host" > $OUT/tests.log 2>&1; tail -12 $OUT/tests.log
python -m benchmarks.gpu.run peer_titan_1gpu_qwen3_compiled --no-install --out $OUT --time-limit 300 2>&1 | tail -4
timeout 60 python -m benchmarks.harness.bench_main_grad_ops --rounds 5 > $OUT/bench_main_grad.log 2>&1; tail -15 $OUT/bench_main_grad.log
