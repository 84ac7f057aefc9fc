#!/usr/bin/env python3
"""Rate of lock+unlock pairs (fcntl POSIX locks, whole file) through one descriptor.

Usage: bench/lock_pairs.py FILE [N]   (FILE is created if missing; N pairs, default 5000)
Prints one line: pairs per second.
"""
import fcntl
import os
import sys
import time

path = sys.argv[1]
n = int(sys.argv[2]) if len(sys.argv) > 2 else 5000
fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
t0 = time.monotonic()
for _ in range(n):
    fcntl.lockf(fd, fcntl.LOCK_EX)
    fcntl.lockf(fd, fcntl.LOCK_UN)
print("%.0f lock+unlock pairs/s" % (n / (time.monotonic() - t0)))
