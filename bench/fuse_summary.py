#!/usr/bin/env python3
"""Summary of bench/fuse_compare.sh's raw results: medians, every run, ratios vs targets.

Usage: bench/fuse_summary.py RESULTS [NPROC]
"""
import json
import statistics as st
import sys

path = sys.argv[1]
nproc = int(sys.argv[2]) if len(sys.argv) > 2 else 4
md = {}    # (fs, mode, phase) -> [dict]
fsm = {}   # (fs, mode) -> [dict]
dd = {}    # fs -> [dict]
dd4k = {}  # fs -> [(MB/s, check)]
tarf = {}  # fs -> [{'tar': entries/s, 'find': entries/s, 'ok': str}]
busy = []
foreign = {}  # (fs, workload) -> [foreign CPU % per run]
for line in open(path):
    parts = line.split(None, 4)
    if len(parts) < 4:
        continue
    r, fs, w, b = parts[:4]
    rest = parts[4] if len(parts) > 4 else ''
    bf = b.split('=')[1].split('/')
    busy.append(int(bf[0]))
    if len(bf) > 1:
        foreign.setdefault((fs, w), []).append(int(bf[1]))
    if w.startswith('mdrate-'):
        mode = w.split('-', 1)[1]
        try:
            j = json.loads(rest)
        except ValueError:
            j = {}
        for ph in ('create', 'stat', 'remove'):
            if ph in j:
                md.setdefault((fs, mode, ph), []).append(j[ph])
    elif w.startswith('fsmark-'):
        mode = w.split('-', 1)[1]
        f = rest.split()
        if len(f) >= 23:
            x = [float(v) for v in f[:23]]
            fsm.setdefault((fs, mode), []).append({
                'files_per_sec': x[3], 'creat_us': x[6], 'close_us': x[18],
                'unlink_us': x[21], 'unlink_per_sec': nproc * 1e6 / x[21] if x[21] else 0,
            })
    elif w == 'tarfind':
        f = rest.split()
        try:
            tarf.setdefault(fs, []).append({'tar': float(f[1]) / float(f[2]),
                                            'find': float(f[4]) / float(f[5]), 'ok': f[6]})
        except (ValueError, IndexError, ZeroDivisionError):
            tarf.setdefault(fs, []).append({'tar': 0.0, 'find': 0.0, 'ok': 'failed'})
    elif w == 'dd4k':
        f = rest.split()
        try:
            dd4k.setdefault(fs, []).append((float(f[1]) / float(f[2]) / 1e6, f[3]))
        except (ValueError, IndexError):
            dd4k.setdefault(fs, []).append((0.0, 'failed'))
    elif w == 'dd':
        f = rest.split()
        try:
            wb, ws, rb, rs = float(f[1]), float(f[2]), float(f[4]), float(f[5])
            dd.setdefault(fs, []).append({'write': wb / ws / 1e6, 'read': rb / rs / 1e6,
                                          'md5': f[6], 'rand': f[7]})
        except (ValueError, IndexError):
            dd.setdefault(fs, []).append({'write': 0, 'read': 0, 'md5': 'failed', 'rand': 'failed'})

fss = []
for k in list(md) + list(fsm) + list(dd) + list(dd4k) + list(tarf):
    fs = k if isinstance(k, str) else k[0]
    if fs not in fss:
        fss.append(fs)


def med(v):
    return st.median(v) if v else float('nan')


def fmt(x):
    return f"{x:,.0f}" if x == x else "-"


def ratio(a, b):
    return a / b if b and b == b and a == a else float('nan')


if md:
    print(f"\n== mdrate: {nproc} processes, create/stat/remove of empty files "
          "(ops/s, median of runs; [runs]; median p50 latency)")
    for mode in ('unique', 'shared'):
        for fs in fss:
            cells = []
            for ph in ('create', 'stat', 'remove'):
                v = md.get((fs, mode, ph), [])
                errs = sum(x['errors'] for x in v)
                cell = (f"{ph} {fmt(med([x['ops_per_sec'] for x in v]))} "
                        f"{[round(x['ops_per_sec']) for x in v]} p50 "
                        f"{med([x['p50_us'] for x in v]):.0f}us")
                if errs:
                    cell += f" ERRORS {errs} ({v[0].get('first_errno', '')})"
                cells.append(cell)
            fg = foreign.get((fs, 'mdrate-' + mode))
            print(f"  {mode:6} {fs:8} " + " | ".join(cells) + (f"  foreign% {fg}" if fg else ""))
    for k_fs in ('kochab', 'kochab_nofsync'):
        # Issue 10's targets: >= 3x MooseFS and >= bindfs on each phase.
        for base, target in (('moosefs', 3.0), ('bindfs', 1.0), ('ext4', None), ('ext4j', None),
                             ('kochab_base', None), ('kochab_dirsync', None), ('kochab_sync', None)):
            if k_fs not in fss or base not in fss or k_fs == base:
                continue
            print(f"  ratio {k_fs}/{base}" + (f" (target >= {target:g}x)" if target else ""))
            for mode in ('unique', 'shared'):
                cells = []
                for ph in ('create', 'stat', 'remove'):
                    k = med([x['ops_per_sec'] for x in md.get((k_fs, mode, ph), [])])
                    b = med([x['ops_per_sec'] for x in md.get((base, mode, ph), [])])
                    q = ratio(k, b)
                    mark = '' if not target else (' ok' if q >= target else ' SHORT')
                    cells.append(f"{ph} {q:.2f}x{mark}")
                print(f"    {mode:6} " + " | ".join(cells))

if fsm:
    print(f"\n== fs_mark -n N -s 0 -S 0 -t {nproc}: Files/sec (create+close loop; sum of per-process "
          "rates), median [runs]; avg creat/close/unlink us; unlink/s = procs*1e6/avg unlink us")
    for mode in ('unique', 'shared'):
        for fs in fss:
            v = fsm.get((fs, mode), [])
            print(f"  {mode:6} {fs:8} files/s {fmt(med([x['files_per_sec'] for x in v]))} "
                  f"{[round(x['files_per_sec']) for x in v]}  creat {med([x['creat_us'] for x in v]):.0f}us"
                  f" close {med([x['close_us'] for x in v]):.0f}us unlink "
                  f"{med([x['unlink_us'] for x in v]):.0f}us (~{fmt(med([x['unlink_per_sec'] for x in v]))}/s "
                  f"{[round(x['unlink_per_sec']) for x in v]})"
                  + (f"  foreign% {foreign[(fs, 'fsmark-' + mode)]}" if (fs, 'fsmark-' + mode) in foreign else ""))
    for k_fs in ('kochab', 'kochab_nofsync'):
        # Issue 10's target is a third of ext4; MooseFS is shown without one.
        for base, target in (('ext4', 1 / 3), ('ext4j', 1 / 3), ('moosefs', None), ('kochab_base', 1.0)):
            if k_fs not in fss or base not in fss:
                continue
            cells = []
            for mode in ('unique', 'shared'):
                k = med([x['files_per_sec'] for x in fsm.get((k_fs, mode), [])])
                b = med([x['files_per_sec'] for x in fsm.get((base, mode), [])])
                ku = med([x['unlink_per_sec'] for x in fsm.get((k_fs, mode), [])])
                bu = med([x['unlink_per_sec'] for x in fsm.get((base, mode), [])])
                q = ratio(k, b)
                mark = '' if target is None else f" ({'ok' if q >= target else 'SHORT'})"
                cells.append(f"{mode} files/s {q:.3f}x{mark}, unlink {ratio(ku, bu):.3f}x")
            goal = '' if target is None else f" (target >= {target:.3g}x)"
            print(f"  ratio {k_fs}/{base}{goal}: " + " | ".join(cells))

if dd:
    print("\n== dd 1 MiB blocks: write (conv=fsync) / read after drop_caches, MB/s (1e6 bytes/s), "
          "median [runs]; data checks")
    for fs in fss:
        v = dd.get(fs, [])
        if not v:
            continue
        w = [x['write'] for x in v]
        rd = [x['read'] for x in v]
        checks = sorted({x['md5'] for x in v} | {x['rand'] for x in v})
        tgt = ''
        if fs.startswith('kochab'):
            tgt = (f"  target >= 500 each way: write {'ok' if med(w) >= 500 else 'SHORT'},"
                   f" read {'ok' if med(rd) >= 500 else 'SHORT'}")
        print(f"  {fs:8} write {med(w):7.0f} {[round(x) for x in w]}  read {med(rd):7.0f} "
              f"{[round(x) for x in rd]}  {' '.join(checks)}{tgt}"
              + (f"  foreign% {foreign[(fs, 'dd')]}" if (fs, 'dd') in foreign else ""))

if dd4k:
    print("\n== dd 4 KiB blocks, write with conv=fsync, MB/s, median [runs]; data check")
    for fs in fss:
        v = dd4k.get(fs, [])
        if v:
            print(f"  {fs:8} write {med([x[0] for x in v]):7.0f} {[round(x[0]) for x in v]}  "
                  f"{' '.join(sorted({x[1] for x in v}))}")
    for k_fs in ('kochab', 'kochab_nofsync'):
        for base in ('ext4', 'ext4j', 'moosefs', 'bindfs', 'kochab_base', 'kochab_sync'):
            if k_fs in dd4k and base in dd4k:
                q = ratio(med([x[0] for x in dd4k[k_fs]]), med([x[0] for x in dd4k[base]]))
                tgt = f" (target >= 0.8x: {'ok' if q >= 0.8 else 'SHORT'})" if base.startswith('ext4') else ''
                print(f"  ratio {k_fs}/{base}: {q:.2f}x{tgt}")

if tarf:
    print("\n== tar -x of a Linux tree of empty files, 2 processes at once; then find over both "
          "from cold caches, 2 processes: entries/s, median [runs]")
    for fs in fss:
        v = tarf.get(fs, [])
        if v:
            print(f"  {fs:14} tar {fmt(med([x['tar'] for x in v]))} {[round(x['tar']) for x in v]}  "
                  f"find {fmt(med([x['find'] for x in v]))} {[round(x['find']) for x in v]}  "
                  f"{' '.join(sorted({x['ok'] for x in v}))}")
    for k_fs in ('kochab', 'kochab_nofsync'):
        for base in ('moosefs', 'bindfs', 'ext4', 'kochab_dirsync', 'kochab_sync', 'kochab_base'):
            if k_fs in tarf and base in tarf:
                cells = []
                for ph in ('tar', 'find'):
                    q = ratio(med([x[ph] for x in tarf[k_fs]]), med([x[ph] for x in tarf[base]]))
                    tgt = f" (target >= 3x: {'ok' if q >= 3 else 'SHORT'})" if base == 'moosefs' else ''
                    cells.append(f"{ph} {q:.2f}x{tgt}")
                print(f"  ratio {k_fs}/{base}: " + " | ".join(cells))

if busy:
    print(f"\nCPU busy in the second before each measurement: median {med(busy):.0f}%, "
          f"max {max(busy)}%")
if foreign:
    allf = [x for v in foreign.values() for x in v]
    print(f"foreign CPU during the measurements (% of all CPU time used by anything but the workload "
          f"and our daemons): median {med(allf):.0f}%, max {max(allf)}%; runs above 20%: "
          f"{sum(x > 20 for x in allf)} of {len(allf)}")
