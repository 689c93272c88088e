"""What every area's command module (``ctrain/*/cli.py``) shares with the root group in
:mod:`ctrain.cli`, without importing it (which gathers them): the project config of this invocation."""

from __future__ import annotations

import click

from ctrain.config import ProjectConfig, load_config


def project(ctx: click.Context) -> ProjectConfig:
    """The project config, loaded once per invocation (``--config`` or ``ctrain.yaml``)."""
    root = ctx.find_root()
    if "config" not in root.meta:
        root.meta["config"] = load_config(root.params.get("config"))
    return root.meta["config"]
