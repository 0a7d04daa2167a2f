"""GPU paths of the tensor plane: CUDA IPC between same-host daemons and NCCL point-to-point.
Run on a machine with CUDA (the `device` tool's GPU machine); elsewhere they skip saying why."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from hfrt.deploy.launchers.base import expand
from tests.support import local_cluster

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CUDA IPC and NCCL paths); none here"),
]


async def test_cuda_tensors_move_by_ipc_between_local_daemons() -> None:
    specs = expand("src", 1, "probe") + expand("dst", 1, "probe")
    async with local_cluster(specs) as (ctl, _):
        src, dst = await asyncio.gather(ctl.role("src"), ctl.role("dst"))
        handle = await src.cuda_tensor.call_one(0, 4 * 2**20)
        assert handle.device.startswith("cuda")
        result = await dst.timed_pull.call_one(0, handle, None, 2)
        assert result["backend"] == "cuda_ipc"
        assert await dst.total.call_one(0, handle) == await src.total.call_one(0, handle)


@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="NCCL refuses two ranks on one GPU; needs two CUDA devices (one per daemon)"
)
async def test_nccl_data_plane_moves_cuda_rows() -> None:
    specs = [dataclasses.replace(s, options={"transfer": "dist"}, env={"CUDA_VISIBLE_DEVICES": str(i)})
             for i, s in enumerate(expand("src", 1, "probe") + expand("dst", 1, "probe"))]
    async with local_cluster(specs) as (ctl, _):
        src, dst = await asyncio.gather(ctl.role("src"), ctl.role("dst"))
        await ctl.form_data_plane("nccl")
        handle = await src.cuda_tensor.call_one(0, 4 * 2**20)
        assert await dst.total.call_one(0, handle) == await src.total.call_one(0, handle)
