"""What the transformers tests share: stacks as dicts, and the text prompts are cut from."""

from __future__ import annotations

#: a passage of ordinary prose the prompts are cut from (tokenized without a chat template)
PASSAGE = (
    "The river rose slowly through the night, and by morning the lower fields were under a "
    "sheet of brown water. Farmers walked the levees with lanterns, counting the sandbags and "
    "arguing about whether the old bridge would hold. Nobody slept much. At dawn the rain "
    "stopped, the clouds broke into long grey ribbons, and a heron stood in the flooded orchard "
    "as if it had always lived there. By noon the water had begun to fall, leaving a line of "
    "silt on every fence post to show how high it had come. The children were the first to "
    "notice the fish trapped in the furrows, silver and astonished, and they spent the whole "
    "afternoon carrying them back to the river in buckets."
)


def cpu_tier(capacity: str = "64MiB") -> dict:
    return {"name": "cpu", "kind": "cpu", "capacity": capacity}


def disk_tier(kind: str, path, name: str = "disk", **options) -> dict:
    return {"name": name, "kind": kind, "path": str(path), "capacity": "256MiB", **options}


def valkey_tier(server, **options) -> dict:
    return {"name": "shared", "kind": "valkey", "url": server.url, **options}


def stack(*tiers: dict) -> dict:
    return {"tiers": [cpu_tier(), *tiers]}
