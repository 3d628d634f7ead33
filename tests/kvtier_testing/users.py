"""Throwaway unprivileged users for the tests that check what another user can reach."""

from __future__ import annotations

import pwd
import secrets
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

__all__ = ["throwaway_user"]


@contextmanager
def throwaway_user(prefix: str, *options: str) -> Iterator[pwd.struct_passwd]:
    """A new user named ``prefix`` plus random hex (``useradd -M -s nologin`` plus ``options``);
    its passwd entry; removed afterwards.

    useradd and userdel fail while another process holds /etc/passwd's lock, which happens
    when two tests (two xdist workers) make users at once: both are retried for a while.
    """
    name = f"{prefix}{secrets.token_hex(3)}"
    for _ in range(50):
        made = subprocess.run(
            ["useradd", "-M", "-s", "/usr/sbin/nologin", *options, name],
            capture_output=True,
            text=True,
            check=False,
        )
        if made.returncode == 0:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"useradd {name}: {made.stderr}")
    try:
        yield pwd.getpwnam(name)
    finally:
        for _ in range(50):
            if subprocess.run(["userdel", name], capture_output=True, check=False).returncode in (0, 6):
                break
            time.sleep(0.2)
