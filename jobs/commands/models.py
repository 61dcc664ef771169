"""``clipforge models import PATH --from F``: a published checkpoint in as clipforge weights."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_to(commands: argparse._SubParsersAction) -> None:
    models = commands.add_parser(
        "models", help="published checkpoints in: VideoMAE, VideoMAE V2, Hugging Face, torchvision"
    )
    verbs = models.add_subparsers(metavar="VERB")
    imp = verbs.add_parser(
        "import",
        help="a downloaded checkpoint as clipforge weights and their architecture record, for --model.weights or "
        "clipforge registry push",
    )
    imp.add_argument("path", help="the checkpoint: a .pth (VideoMAE, torchvision) or a Hugging Face folder")
    imp.add_argument("--from", dest="source", required=True, choices=["videomae", "videomaev2", "hf", "torchvision"])
    imp.add_argument("--name", required=True, help="the imported model's folder name (and a registry name for it)")
    imp.add_argument("--out", default="models", help="where the NAME folder goes (default: models/)")
    imp.add_argument("--model", default=None, help="the torchvision architecture (r2plus1d_18, mvit_v2_s, ...)")
    imp.add_argument("--frames", type=int, default=None, help="frames per clip it was trained at (VideoMAE: 16)")
    imp.add_argument("--image-size", type=int, default=None, help="frame size it was trained at (VideoMAE: 224)")
    imp.add_argument("--heads", type=int, default=None, help="attention heads, when not the size's usual number")
    imp.add_argument("--classes", type=Path, default=None, help="a file of class names, one per line, in order")
    imp.set_defaults(func=_import)


def _import(args: argparse.Namespace, rest: list[str]) -> int:
    from clipforge.models.imports import import_checkpoint

    out = Path(args.out) / args.name
    weights, imported = import_checkpoint(
        Path(args.path), args.source, out, args.model, args.frames, args.image_size, args.heads, args.classes
    )
    kind = "encoder (pretraining, no classifier)" if imported.encoder_only else f"{len(imported.classes)} classes"
    arch = ", ".join(f"{k} {v}" for k, v in imported.overrides.items())
    print(
        f"imported {args.path} ({args.source}) as {imported.model} [{arch}], {kind}, "
        f"{imported.frames}x{imported.image_size}x{imported.image_size} clips"
    )
    for note in imported.notes:
        print(f"  {note}")
    print(f"  weights   {weights}")
    print(f"  fine-tune python jobs/train.py --model.weights {out} --data.store STORE ...")
    print(f"  version   clipforge registry push {out} --name {args.name}")
    return 0
