"""bench.py's harness and its CTranslate2 baseline: contenders alternate, and
CTranslate2 decodes our checkpoints to our greedy tokens."""

import pytest

import bench
from loading import load_model

needs_ct2 = pytest.mark.skipif(not bench.ct2_installed(), reason="CTranslate2 is a benchmark reference (pip install ctranslate2)")


def test_alternate_warms_each_contender_up_then_runs_them_in_turn_and_takes_medians():
    calls, seconds = [], {"a": iter([9.0, 1.0, 5.0, 3.0]), "b": iter([9.0, 2.0, 2.0, 8.0])}

    def contender(name):
        def run():
            calls.append(name)
            return next(seconds[name]), f"{name}{len(calls)}"
        return run

    timings = bench.alternate({"a": contender("a"), "b": contender("b")}, repeats=3)
    assert calls == ["a", "b"] * 4  # the warm-up, then three passes in turn
    assert (timings["a"].median, timings["b"].median) == (3.0, 2.0)  # the warm-up's 9 s left out
    assert timings["a"].seconds == [1.0, 5.0, 3.0] and timings["b"].output == "b8"


@needs_ct2
@pytest.mark.parametrize("intel_openmp_runtime", [False, True], ids=["as-installed", "intel-openmp"])
def test_ctranslate2_decodes_each_flavour_to_our_greedy_tokens(checkpoint, tmp_path, intel_openmp_runtime):
    """In float32, to EOS; a forced length (as the speed runs ask) is kept to."""
    if intel_openmp_runtime and bench.intel_openmp() is None:
        pytest.skip("intel-openmp is not installed")
    model = load_model(checkpoint.mlx_dir)
    worker = bench.CT2Worker(checkpoint.hf_dir, "float32", tmp_path, intel_openmp_runtime)
    try:
        assert bench.ct2_same_tokens(model, {"fp32": worker}, [checkpoint.prompt_ids], 24) == "yes"
        assert len(worker.run(checkpoint.prompt_ids, 30, min_tokens=30)["tokens"]) == 30
    finally:
        worker.close()
