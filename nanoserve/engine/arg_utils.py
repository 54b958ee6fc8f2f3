"""vLLM's `vllm.engine.arg_utils`: EngineArgs, an engine's settings (nanoserve/engine/engine_args.py defines it),
and the command-line flags derived from them, which EngineArgs.add_cli_args builds here: a command line needs
them, a plain request never imports them."""
import argparse
import dataclasses
import json
import typing

from nanoserve.engine.engine_args import EngineArgs

__all__ = ["EngineArgs"]


def add_cli_args(cls, parser, flags: dict | None = None):
    """vLLM's: a flag for each setting a command line can hold, named as the field
    (--max-model-len; a yes/no setting also --no-enable-prefix-caching; a dict as JSON), with
    the field's default; from_cli_args reads them back. flags: a command's own take on some
    settings, {name: add_argument's keywords to change (and "aliases": more flag names), or
    None: no flag}."""
    group = parser.add_argument_group("engine arguments (EngineArgs)")
    for setting in dataclasses.fields(cls):
        mine = (flags or {}).get(setting.name, {})
        if setting.name in ("logits_processors", "parts") or mine is None:  # (Python objects)
            continue
        flag, kinds = "--" + setting.name.replace("_", "-"), typing.get_args(setting.type) \
            or (setting.type,)
        if bool in kinds:
            how = dict(action=argparse.BooleanOptionalAction, default=setting.default,
                       help="default: %(default)s")
        else:
            kind = int if int in kinds else float if float in kinds else str
            kind = json.loads if dict in kinds else kind
            how = dict(type=kind, default=setting.default, metavar=setting.name.upper(),
                       help="default: %(default)s")
        how |= mine
        group.add_argument(flag, *how.pop("aliases", ()), **how)
    return parser

