"""The one parser for `host[:slots]` lists: `tfdist-run -H` and host-discovery output.

```python
from tfdist.launch.hosts import parse_host_slots
parse_host_slots("node1:2,node2".split(","), source="-H node1:2,node2")  # [('node1', 2), ('node2', 1)]
```
"""

from __future__ import annotations

from typing import Iterable

from tfdist.errors import LaunchError


def parse_host_slots(entries: Iterable[str], source: str, *, error: type[Exception] = LaunchError,
                     zero_slots: str = "refuse") -> list[tuple[str, int]]:
    """`host[:slots]` entries -> [(host, slots)]; a host without `:N` has 1 slot.

    Args:
        entries: the entries, one host each; blank entries and `#` comments are skipped.
        source: where they came from (the flag or the script), named in the error.
        error: the exception class raised for a malformed entry.
        zero_slots: `"refuse"` (an error, as for `-H`) or `"drop"` (the host is left out, as a
            discovery script reports a host with no free slots).

    Returns:
        (host name, slot count) in the order given.

    Raises:
        error: an entry without a name, with slots that are not a number, or with 0 slots when refused.
    """
    hosts = []
    for entry in entries:
        entry = entry.strip()
        if not entry or entry.startswith("#"):
            continue
        name, _, slots = entry.partition(":")
        count = int(slots) if slots.isdigit() else None
        if not name or (slots and count is None) or (count == 0 and zero_slots == "refuse"):
            raise error(f"{source}: expected host[:slots] entries, got {entry!r}")
        if count != 0:
            hosts.append((name, count or 1))
    return hosts
