"""3D dispatch through real daemons: a role whose daemons declare training and generation
data-parallel axes in their hello gets rows split by training dp for SPLIT endpoints and by
generation dp for SPLIT_GENERATION ones, one reply per group."""

from __future__ import annotations

from pathlib import Path

import pytest

from hfrt.deploy.launchers.base import expand
from tests.support import local_cluster

pytestmark = pytest.mark.timeout(60)

IMPL = f"{Path(__file__).with_name('layout_daemon.py')}:LayoutDaemon"


async def test_split_by_training_and_generation_layouts() -> None:
    specs = expand("actor", 4, IMPL, options={"train": "t4p1d1", "gen": "t2p1d2"})
    async with local_cluster(specs) as (ctl, _):
        actor = await ctl.role("actor")
        assert await actor.train_rows([0, 1, 2, 3]) == [[0, 0], [0, 1], [0, 2], [0, 3]]  # one tp group
        # generation TP groups {0, 2} and {1, 3}: rows 0-1 answered by rank 0, rows 2-3 by rank 1
        assert await actor.gen_rows([0, 1, 2, 3]) == [[0, 0], [0, 1], [1, 2], [1, 3]]
        seen = await actor.gen_rows.call([9])  # every rank, unsplit: all four ran
        assert sorted(r[0][0] for r in seen) == [0, 1, 2, 3]
