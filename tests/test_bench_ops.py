"""dgc.bench.ops: the dispatch counter sees what a GPU would launch and wait for."""

from __future__ import annotations

import json

import pytest
import torch

from dgc.bench import main
from dgc.bench.ops import Counter, bench_ops, buckets, host_reads


def test_the_counter_tells_launches_from_host_synchronizations():
    x = torch.arange(10.0)
    with host_reads() as reads, Counter() as counter:
        y = x * 2 + 1  # two launches, no wait
        n = int((y > 5).sum())  # a comparison, a sum, and the host reads the result
        positions = torch.nonzero(y > 5)  # its size depends on the data
        picked = y[y > 5]  # boolean indexing: the same
        y[:3].tolist()  # a CPU tensor answers without a dispatch: counted apart
        torch.repeat_interleave(x[:3].long(), torch.tensor([1, 2, 3]), output_size=6)  # sized: no wait
    assert n == 7 and positions.numel() == 7 and picked.numel() == 7
    assert counter.syncs == {"_local_scalar_dense": 1, "nonzero": 1, "index": 1}
    assert reads == {"tolist": 1}
    assert counter.by_op["mul"] == 1 and counter.by_op["add"] == 1 and counter.by_op["repeat_interleave"] == 1
    assert counter.views >= 1  # y[:3] is a view


def test_the_bench_counts_one_step_per_model_and_method(tmp_path):
    result = bench_ops(("resnet18",), ("dgc", "none"), density=0.01)
    dgc, dense = result["models"]["resnet18"]["dgc"], result["models"]["resnet18"]["none"]
    assert dgc["tensors"] == dense["tensors"] == 62 and not result["kernels"]
    # the selection reads the host twice (the candidates' number, every tensor's counts) and decodes with a
    # third read; the agreement on non-finite gradients and requests is the dense step's one read
    assert dense["host_syncs"] == 1 and dgc["host_syncs"] <= 4
    assert dense["ops"] < dgc["ops"] <= 150  # one bucket: no operation per tensor
    assert sum(dgc["syncs_by_op"].values()) + sum(dgc["host_reads"].values()) == dgc["host_syncs"]
    out = tmp_path / "ops.json"
    assert main(["ops", "--models", "resnet18", "--methods", "none", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["models"]["resnet18"]["none"]["ops"] == dense["ops"]


def test_the_count_of_dgc_does_not_grow_with_the_number_of_tensors():
    result = bench_ops(("resnet18", "resnet34"), ("dgc",), density=0.001)
    small, large = result["models"]["resnet18"]["dgc"], result["models"]["resnet34"]["dgc"]
    assert large["tensors"] > 1.7 * small["tensors"]
    assert large["ops"] <= 1.05 * small["ops"] and large["host_syncs"] == small["host_syncs"]


def test_an_unknown_method_is_one_line(capsys):
    assert main(["ops", "--models", "resnet18", "--methods", "dgcc"]) == 2
    assert "unknown method dgcc; valid:" in capsys.readouterr().err


def test_buckets_are_ddps_parts_in_backward_order_closed_at_the_cap():
    sizes = (2**18, 10, 2**18, 2**17, 2**17, 2**19)  # 1 MiB, 40 B, 1 MiB, 0.5 MiB, 0.5 MiB, 2 MiB
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    parts = buckets(params, bucket_mb=1.5, first_mb=0.75)
    assert [[p.numel() for p in part] for part in parts] == [[2**19], [2**17, 2**17, 2**18], [10, 2**18]]
    wide = buckets(params, bucket_mb=2.5)
    assert [[p.numel() for p in part] for part in wide] == [[2**19], [2**17, 2**17, 2**18, 10, 2**18]]
    assert [len(part) for part in buckets(params, bucket_mb=100, first_mb=100)] == [6]


def test_the_step_in_parts_costs_a_fixed_count_a_part_not_an_operation_a_tensor(tmp_path):
    result = bench_ops(("resnet18",), ("dgc_chunk", "qsgd", "powersgd"), density=0.01, bucket_mb=5)
    assert result["bucket_mb"] == 5
    for method, row in result["models"]["resnet18"].items():
        parts = row["in_parts"]
        assert parts["parts"] >= 3, method
        # each part sends its own agreement, and the host reads them all once, after the last part; what a
        # compressor derives from its tensors' layout (QSGD's bucket ids, PowerSGD's plan) is kept per part, not
        # made again when the next part comes
        assert parts["host_syncs"] == row["host_syncs"] == 1, method
        assert parts["ops"] <= parts["parts"] * (row["ops"] + 5), (method, parts["ops"], row["ops"])
    # DGC's copy of the state it may undo is one dispatch a part into buffers kept from step to step
    assert "clone" not in result["models"]["resnet18"]["dgc_chunk"]["in_parts"]["by_op"]
    out = tmp_path / "ops.json"
    assert main(["ops", "--models", "resnet18", "--methods", "none", "--bucket-mb", "5", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["models"]["resnet18"]["none"]["in_parts"]["parts"] == parts["parts"]


def test_a_bucket_size_that_is_not_positive_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["ops", "--models", "resnet18", "--bucket-mb", "0"])
    assert exit_.value.code == 2 and "must be a positive number of MiB, got '0'" in capsys.readouterr().err
