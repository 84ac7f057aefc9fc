#!/usr/bin/env python3
"""Latency of single requests through a mount, one process, no concurrency.

Usage: bench/fuse_latency.py DIR [N]   (DIR on the mount; N operations per kind, 2000)
Prints p10/p50/p90 in microseconds of:
  flush   close(dup(fd)): one FLUSH the mount answers itself (nothing to report), no
          server round trip: the cost of a FUSE request alone;
  create  open(O_CREAT|O_EXCL) of a new name: LOOKUP (answered in the mount in a
          directory it made) and CREATE (a server round trip);
  close   close of the new file: FLUSH, RELEASE (both answered in the mount);
  unlink  unlink of it: a server round trip.
Pin the program (taskset) to see the cost of crossing CPUs.
"""
import os
import sys
import time


def pct(samples):
    s = sorted(samples)
    n = len(s)
    return "p10 %.1f p50 %.1f p90 %.1f us" % (s[n // 10] / 1e3, s[n // 2] / 1e3, s[n * 9 // 10] / 1e3)


def main():
    d = os.path.join(sys.argv[1], "fuse_latency.%d" % os.getpid())
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
    os.mkdir(d)
    clock = time.perf_counter_ns
    fd = os.open(os.path.join(d, "held"), os.O_CREAT | os.O_RDWR, 0o644)
    flush = []
    for _ in range(n):
        extra = os.dup(fd)
        t = clock()
        os.close(extra)
        flush.append(clock() - t)
    os.close(fd)
    os.unlink(os.path.join(d, "held"))
    create, close, unlink = [], [], []
    for i in range(n):
        p = os.path.join(d, "f%d" % i)
        t0 = clock()
        f = os.open(p, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o644)
        t1 = clock()
        os.close(f)
        t2 = clock()
        create.append(t1 - t0)
        close.append(t2 - t1)
    for i in range(n):
        t = clock()
        os.unlink(os.path.join(d, "f%d" % i))
        unlink.append(clock() - t)
    os.rmdir(d)
    for name, s in (("flush", flush), ("create", create), ("close", close), ("unlink", unlink)):
        print("%-6s %s" % (name, pct(s)))


if __name__ == "__main__":
    main()
