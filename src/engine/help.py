"""`python train.py --help`: the config groups a user picks, each option with the first line of its file's comment.

Read from conf/ without composing: Hydra's own help composes the config once per option (over a second here) and
lists every group, the test profiles ($PROJECT_PROFILE) and Hydra's internals among them, which this leaves out."""

import re
from pathlib import Path

HIDDEN = re.compile(r"(^|/)profile(/|$)|^hydra$")  # the test suite's sizes; Hydra's own settings
WIDTH = 120


def _defaults(primary: Path) -> dict[str, str]:
    """group -> what the primary config's defaults list picks (`- data: digits`; `null` for none)."""
    chosen = {}
    lines = primary.read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("defaults:")), len(lines))
    for line in lines[start + 1 :]:
        if line.strip() and not line.startswith(" "):
            break
        found = re.match(r"\s*-\s*([\w/]+)\s*:\s*([^#]+?)\s*(#.*)?$", line)
        if found:
            chosen[found.group(1)] = found.group(2)
    return chosen


def summary(path: Path) -> str:
    """The first line of the file's leading comment: each file of conf/ starts with a one-line summary
    (tests/test_config.py holds them to it)."""
    for line in path.read_text().splitlines():
        if line.startswith("# @package"):
            continue
        return line.lstrip("#").strip().rstrip(".") if line.startswith("#") else ""
    return ""


def render(conf: Path, config_name: str, script: str) -> str:
    primary = conf / f"{config_name}.yaml"
    chosen = _defaults(primary)
    groups = sorted(str(p.relative_to(conf)) for p in conf.rglob("*") if p.is_dir() and any(p.glob("*.yaml")))
    shown = [g for g in groups if not HIDDEN.search(g) and (g.split("/")[0] in chosen or g == "hydra/launcher")]
    lines = [
        f"{script}: {summary(primary)}",
        "",
        f"usage: python {script} [group=option ...] [key=value ...]       a sweep: python {script} -m key=a,b,c",
        "",
        "Config groups (pick an option: model=mlp; several where a group takes a list: callbacks=[default,ema]);",
        "* marks the default:",
    ]
    width = max(len(g) for g in shown) if shown else 0
    for group in shown:
        for index, option in enumerate(sorted((conf / group).glob("*.yaml"))):
            name = option.stem + ("*" if option.stem == chosen.get(group) else "")
            line = f"  {group if index == 0 else '':<{width}}  {name:<16} {summary(option)}"
            lines.append(line if len(line) <= WIDTH else line[: WIDTH - 1] + "…")
    lines += [
        "",
        f"The composed config: python {script} --cfg job      (one part of it: --cfg job --package trainer)",
        "Every key and option: docs/configuration.md",
    ]
    return "\n".join(lines)
