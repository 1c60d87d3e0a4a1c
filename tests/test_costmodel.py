"""The internode cost model: its routing statistics against sampled routing, by hand and at
scale, and the shape of its predictions."""

import pytest
import torch

from tritonep.costmodel import (
    Links,
    measured_traffic,
    predict,
    uniform_probabilities,
    uniform_traffic,
)
from tritonep.testing import route


def test_measured_traffic_of_a_hand_example():
    # 2 nodes x 2 GPUs, 8 experts (2 per GPU). Rank 0 (node 0, local 0):
    # token 0 -> experts 2 (rank 1) and 6 (rank 3); token 1 -> expert 4 (rank 2) only.
    ids = [torch.tensor([[2, 6], [4, -1]]), *(torch.full((0, 2), -1) for _ in range(3))]
    t = measured_traffic(ids, 8, gpus_per_node=2)
    # Network: token 0 to node 1, token 1 to node 1 -> 2 rows. NVLink: on node 0 the
    # forwarder (rank 0) sends token 0 to rank 1; on node 1 the forwarder (rank 2) sends
    # token 0 to rank 3 -> 2 rows. Received: token 0 at ranks 1 and 3, token 1 at rank 2.
    assert (t.network_rows, t.nvlink_rows, t.received_rows) == (2 / 4, 2 / 4, 3 / 4)


@pytest.mark.parametrize("nodes, gpus", [(1, 4), (2, 2), (2, 4), (4, 2)])
def test_uniform_formula_matches_sampled_routing(nodes, gpus):
    E, K, N = 64, 8, 3000
    gen = torch.Generator().manual_seed(nodes * 10 + gpus)
    ids = [route(gen, N, E, K, "random") for _ in range(nodes * gpus)]
    got = measured_traffic(ids, E, gpus)
    want = uniform_traffic(N, E, K, nodes, gpus)
    for field in ("network_rows", "nvlink_rows", "received_rows"):
        w, g = getattr(want, field), getattr(got, field)
        assert abs(g - w) <= 0.02 * max(w, 1.0), (field, g, w)
    if nodes == 1:
        assert got.network_rows == want.network_rows == 0


def test_predictions():
    p_node, p_rank = uniform_probabilities(256, 8, 4, 8)
    assert 0 < p_rank < p_node < 1
    links = Links(nvlink_gbps=370, network_gbps=45, fixed_us=25)
    one = predict(uniform_traffic(4096, 256, 8, 1, 8), 7168, links=links)
    assert one["dispatch_network_MB"] == 0
    times = [
        predict(uniform_traffic(4096, 256, 8, m, 8), 7168, links=links)["dispatch_us"]
        for m in (2, 4, 8, 16, 32)
    ]
    assert times == sorted(times)  # more nodes, more network rows per GPU
    fp8 = predict(uniform_traffic(4096, 256, 8, 4, 8), 7168, use_fp8=True, links=links)
    bf16 = predict(uniform_traffic(4096, 256, 8, 4, 8), 7168, links=links)
    assert fp8["dispatch_us"] < bf16["dispatch_us"] and fp8["combine_us"] == bf16["combine_us"]
    # Pipelined legs take the slower one; the serial bound adds them.
    two = predict(uniform_traffic(4096, 256, 8, 2, 8), 7168, links=links)
    t_net = two["dispatch_network_MB"] * 1e3 / 45
    t_nvl = two["dispatch_nvlink_MB"] * 1e3 / 370
    assert two["dispatch_us"] == pytest.approx(25 + max(t_net, t_nvl))
    assert two["dispatch_serial_us"] == pytest.approx(25 + t_net + t_nvl)
    # Emulated nodes: each leg at the kernels' one-peer rate, the legs adding up.
    emulated = Links(nvlink_gbps=370, network_gbps=45, fixed_us=25, emulated_leg_gbps=200)
    shared = predict(uniform_traffic(4096, 256, 8, 2, 2), 7168, links=emulated, shared_links=True)
    mb = shared["dispatch_network_MB"] + shared["dispatch_nvlink_MB"]
    assert shared["dispatch_us"] == pytest.approx(25 + mb * 1e3 / 200)
    # The 2 x 2 run on 4x H200 (2026-11-26): 58.5 + 106.5 MB per GPU, cached dispatch 886 us.
    assert 800 < shared["dispatch_us"] < 900
