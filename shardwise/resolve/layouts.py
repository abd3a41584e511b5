"""``shardwise verify``'s layouts: ``"tp=2,dp_shard=2"`` strings, checked and completed for a number of
ranks before any run (torch-free: the CLI answers a bad one at once)."""

from __future__ import annotations

import math

from shardwise.config.schema import ConfigError
from shardwise.parallel.dims import DEGREES, Mesh

__all__ = ["fill_layouts", "layout_degrees", "parse_layout"]


def parse_layout(text: str) -> tuple[list[str], int]:
    """``"tp=2,dp_shard=2"`` -> (CLI overrides, world size). Bare keys are ``parallel.*``; dotted
    keys (``optimizer.lr=...``) pass through, which lets a test prove that verify can fail."""
    overrides, degrees = _parse(text)
    world = math.prod(v for k, v in degrees.items() if k != Mesh.EP)
    return overrides + [f"--parallel.{k}={v}" for k, v in degrees.items()], world


def layout_degrees(text: str) -> dict[str, int]:
    """``"tp=2,dp_shard=2"`` -> every mesh degree of the layout (1 where it sets none)."""
    return _parse(text)[1]


def _parse(text: str) -> tuple[list[str], dict[str, int]]:
    """The layout's pass-through overrides, and its degrees."""
    overrides, degrees = [], dict.fromkeys(DEGREES, 1)
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"layout '{text}': expected key=value items, e.g. tp=2,dp_shard=2")
        if "." in key:
            overrides.append(f"--{key}={value}")
            continue
        if key not in DEGREES:
            raise ConfigError(f"layout '{text}': unknown degree '{key}'; use {', '.join(DEGREES)}")
        try:
            degrees[key] = int(value)
        except ValueError:
            raise ConfigError(f"layout '{text}': {key} must be an integer, got '{value}'") from None
        if degrees[key] < 1:
            raise ConfigError(f"layout '{text}': {key} must be >= 1, got {degrees[key]}")
    return overrides, degrees


def fill_layouts(layouts: list[str] | None, nproc: int | None, experts: bool = False, flag: str = "--nproc"
                 ) -> list[str]:
    """The layouts to verify, each checked. With ``nproc`` (``--nproc``), each runs on that many
    ranks: a layout that does not set dp_shard gets the rest of them, one that sets every degree
    must multiply to it; with no ``layouts``, plain FSDP over ``nproc`` ranks and (``nproc`` even)
    2-way TP beside FSDP over the other half; for a model with ``experts`` (``nproc`` even), 2-way
    expert parallel too, beside that TP where ``nproc`` is a multiple of 4 (EP x FSDP x TP).
    ``flag``: the option that gave ``nproc``, as errors name it (``--ranks``: simulated ranks)."""
    if layouts is None:
        if nproc is None:
            raise ConfigError("verify needs --layouts (e.g. dp_shard=2 tp=2) or --nproc N (the standard "
                              "layouts of N ranks)")
        out = [f"dp_shard={nproc}"] + ([f"tp=2,dp_shard={nproc // 2}"] if nproc % 2 == 0 else [])
        if experts and nproc % 2 == 0:
            out.append(f"ep=2,tp=2,dp_shard={nproc // 2}" if nproc % 4 == 0 else f"ep=2,dp_shard={nproc}")
        return out
    out = []
    for text in layouts:
        _, world = parse_layout(text)  # (a bad layout fails here, before any run)
        if nproc is None:
            out.append(text)
            continue
        if Mesh.DP_SHARD not in (item.partition("=")[0] for item in text.split(",")):
            if nproc % world:
                raise ConfigError(f"layout '{text}' uses {world} ranks, which do not divide {flag} {nproc}")
            text, world = ",".join(filter(None, [text, f"dp_shard={nproc // world}"])), nproc
        if world != nproc:
            raise ConfigError(f"layout '{text}' uses {world} ranks, not {flag} {nproc}: change its degrees "
                              "or leave dp_shard out to fill it")
        out.append(text)
    return out
