"""benchmarks/harness/roofline.py: kernels classed by name, each class's work by formula."""

import json

import pytest

from benchmarks.harness import roofline

FLAGS = ["--preset", "qwen3-30b-a3b-proxy", "--micro-batch-size", "1", "--num-microbatches", "2"]


def test_kernels_are_classed_by_name():
    assert roofline.class_of("_grouped_wgrad_kernel") == "expert GEMMs"
    assert roofline.class_of("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "dense GEMMs"
    assert roofline.class_of("_adamw_flat_kernel") == "optimizer"
    assert roofline.class_of("cudnn_generated_fort_native_sdpa_sm90_flash_bprop") == "attention"
    assert roofline.class_of("_ce_bwd_kernel") == "loss"
    assert roofline.class_of("something_else") == roofline.OTHER


def test_the_work_follows_the_shapes_and_the_padded_vocabulary():
    shapes = roofline.work(FLAGS)
    assert shapes["tokens"] == 8192
    # experts: 6 T k 3 H Fe over 6 layers; the logit GEMM's V is 151937 padded to 152064
    assert shapes["expert GEMMs"][0] == pytest.approx(6 * 8192 * 8 * 3 * 2048 * 768 * 6 / 1e12)
    assert shapes["parameters"] > 2 * 152064 * 2048 + 6 * 128 * 3 * 2048 * 768
    assert shapes["optimizer"] == (pytest.approx(30 * shapes["parameters"] / 1e9), "GB")


def test_rows_put_each_class_against_its_limit(tmp_path, capsys):
    table = {"steps": 3, "ranks": [{"kernel_ms": 100.0, "top": [
        {"name": "_grouped_wgrad_kernel", "ms": 22.26},
        {"name": "_adamw_flat_kernel", "ms": 60.0},
        {"name": "mystery", "ms": 5.0}]}]}
    path = tmp_path / "k.json"
    path.write_text(json.dumps(table))
    found = {r["class"]: r for r in roofline.rows(table, FLAGS, 989.0, 4300.0)}
    assert found["expert GEMMs"]["left"] == pytest.approx(22.26 / found["expert GEMMs"]
                                                          ["at_limit_ms"])
    assert found["optimizer"]["unit"] == "GB"
    assert found[roofline.OTHER]["ms"] == pytest.approx(100.0 - 22.26 - 60.0)  # mystery + unlisted
    assert roofline.main([str(path), "--flags", " ".join(FLAGS), "--step-ms", "120"]) == 0
    assert "host gaps and overlap: +20.0 ms" in capsys.readouterr().out
