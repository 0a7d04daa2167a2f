"""A daemon that declares training and generation data-parallel axes from two layouts in its
options (as a TP actor does), for the 3D dispatch test. Not a test module."""

from __future__ import annotations

from typing import Any

from hfrt import Daemon, Dispatch, endpoint


class LayoutDaemon(Daemon):
    def dp_axes(self) -> dict[str, list[int]]:
        from hfrt.roles.training.parallel.layout import Layout, dp_axes

        opts = self.context.options
        return dp_axes(Layout.parse(opts["train"]), Layout.parse(opts["gen"]), self.context.rank)

    @endpoint(dispatch=Dispatch.SPLIT)
    def train_rows(self, rows: list[Any]) -> list[list[Any]]:
        return [[self.context.rank, r] for r in rows]

    @endpoint(dispatch=Dispatch.SPLIT_GENERATION)
    def gen_rows(self, rows: list[Any]) -> list[list[Any]]:
        return [[self.context.rank, r] for r in rows]
