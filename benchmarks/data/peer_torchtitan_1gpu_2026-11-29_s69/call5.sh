# session 69, call 5 (warm nvidia-h200): the Mixtral-like and DeepSeek-like peer recipes
export PYTHONUNBUFFERED=1
python -m benchmarks.gpu.run peer_titan_1gpu_mixtral_compiled peer_titan_1gpu_dsv3_compiled --out $OUT --time-limit 570 2>&1 | tail -6
