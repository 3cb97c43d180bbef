"""Processes and ranks: whether a pid names a live process on this host, and the barrier of a torch.distributed
group (a no-op outside one)."""

from __future__ import annotations

import os


def pid_alive(pid: object) -> bool | None:
    """Whether ``pid`` is a live process on this host: True when it exists (ours or another user's), False when no
    process has it, None when it is no pid to ask about (not a positive int, or beyond the system's range). Each
    caller decides what None means: a lock or a temporary is never taken as dead on it, a report says nothing."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OverflowError:
        return None
    except OSError:  # PermissionError: it exists, owned by someone else
        return True
    return True


def barrier() -> None:
    """Every rank of the default process group waits here; nothing happens without one (or with one rank)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
