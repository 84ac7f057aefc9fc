/*
 * mdrate: the workload of `kochab bench` through a mounted file system (mdtest-like).
 *
 *   mdrate DIR NPROC NFILES unique|shared [PAUSE_S [PHASES]]
 *
 * NPROC processes each create (open O_CREAT|O_EXCL|O_WRONLY, then close), then stat, then
 * remove (unlink) NFILES empty files: in a directory of their own (DIR/p<i>) or all in
 * DIR/shared. Phases are separated by a barrier; a phase's time runs from the earliest
 * start to the latest end over all processes, its rate is NPROC*NFILES / that time.
 * Names are resolved relative to an open directory descriptor (openat/fstatat/unlinkat),
 * so only the last component is looked up. Between phases every process sleeps PAUSE_S
 * seconds (default 2, untimed), longer than the 1 s entry/attribute cache of FUSE mounts,
 * so every stat and unlink reaches the file system daemon instead of the kernel's cache.
 * PHASES (default "csr") picks create/stat/remove: without c the files and directories must
 * already exist (from a run without r), without r they are left in place (for profiling
 * one phase at a time). Otherwise DIR must exist without the names used, and the
 * directories made are removed at the end.
 * With MDRATE_TAG set, file names start with it and an existing DIR/shared is used: several
 * instances (on several mounts of one file system) can then share one directory.
 * Prints one JSON object: per phase ops_per_sec, p50_us, p99_us, max_us, errors, first errno.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

enum { CREATE, STAT, REMOVE, NPHASE };
static const char *phase_name[NPHASE] = {"create", "stat", "remove"};

struct proc_res {
    double start[NPHASE], end[NPHASE];
    long errors[NPHASE];
    int first_errno[NPHASE];
};

struct shared {
    pthread_barrier_t barrier;
    struct proc_res res[];
};

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int cmp_float(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s DIR NPROC NFILES unique|shared [PAUSE_S [PHASES]]\n", argv[0]);
        return 2;
    }
    const char *dir = argv[1];
    int nproc = atoi(argv[2]);
    long nfiles = atol(argv[3]);
    int shared = strcmp(argv[4], "shared") == 0;
    double pause_s = argc > 5 ? atof(argv[5]) : 2.0;
    const char *phases = argc > 6 ? argv[6] : "csr";
    int run[NPHASE] = {strchr(phases, 'c') != NULL, strchr(phases, 's') != NULL,
                       strchr(phases, 'r') != NULL};
    if (nproc < 1 || nfiles < 1 || (!shared && strcmp(argv[4], "unique") != 0)) {
        fprintf(stderr, "bad arguments\n");
        return 2;
    }

    size_t shsz = sizeof(struct shared) + nproc * sizeof(struct proc_res);
    struct shared *sh = mmap(NULL, shsz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    size_t latsz = (size_t)NPHASE * nproc * nfiles * sizeof(float);
    float *lat = mmap(NULL, latsz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (sh == MAP_FAILED || lat == MAP_FAILED) {
        perror("mmap");
        return 1;
    }
    memset(lat, 0, latsz); /* touch the memory before any timing */
    pthread_barrierattr_t ba;
    pthread_barrierattr_init(&ba);
    pthread_barrierattr_setpshared(&ba, PTHREAD_PROCESS_SHARED);
    pthread_barrier_init(&sh->barrier, &ba, nproc);

    const char *tag = getenv("MDRATE_TAG");
    char path[4096];
    for (int p = 0; p < (shared ? 1 : nproc); p++) {
        if (shared)
            snprintf(path, sizeof path, "%s/shared", dir);
        else
            snprintf(path, sizeof path, "%s/p%d", dir, p);
        if (run[CREATE] && mkdir(path, 0755) != 0 && !(tag && shared && errno == EEXIST)) {
            fprintf(stderr, "mkdir %s: %s\n", path, strerror(errno));
            return 1;
        }
    }

    for (int p = 0; p < nproc; p++) {
        pid_t pid = fork();
        if (pid < 0) {
            perror("fork");
            return 1;
        }
        if (pid > 0)
            continue;
        /* child p */
        if (shared)
            snprintf(path, sizeof path, "%s/shared", dir);
        else
            snprintf(path, sizeof path, "%s/p%d", dir, p);
        int dfd = open(path, O_RDONLY | O_DIRECTORY);
        if (dfd < 0) {
            fprintf(stderr, "open %s: %s\n", path, strerror(errno));
            _exit(1);
        }
        char (*names)[64] = malloc(nfiles * 64);
        for (long i = 0; i < nfiles; i++)
            snprintf(names[i], 64, "%.8s%sp%d.f%ld", tag ? tag : "", tag ? "." : "", p, i);
        struct proc_res *r = &sh->res[p];
        int ran = 0;
        for (int ph = 0; ph < NPHASE; ph++) {
            if (!run[ph])
                continue;
            if (ran++ && pause_s > 0) {
                struct timespec ts = {(time_t)pause_s, (long)((pause_s - (time_t)pause_s) * 1e9)};
                nanosleep(&ts, NULL);
            }
            float *l = lat + ((size_t)ph * nproc + p) * nfiles;
            pthread_barrier_wait(&sh->barrier);
            r->start[ph] = now();
            for (long i = 0; i < nfiles; i++) {
                double t0 = now();
                int rc;
                if (ph == CREATE) {
                    int fd = openat(dfd, names[i], O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0644);
                    rc = fd < 0 ? -1 : close(fd);
                } else if (ph == STAT) {
                    struct stat st;
                    rc = fstatat(dfd, names[i], &st, 0);
                } else {
                    rc = unlinkat(dfd, names[i], 0);
                }
                l[i] = (float)((now() - t0) * 1e6);
                if (rc != 0) {
                    if (r->errors[ph]++ == 0)
                        r->first_errno[ph] = errno;
                }
            }
            r->end[ph] = now();
        }
        _exit(0);
    }
    int bad = 0;
    for (int p = 0; p < nproc; p++) {
        int st;
        if (wait(&st) < 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0)
            bad = 1;
    }
    if (bad) {
        fprintf(stderr, "a worker process failed\n");
        return 1;
    }

    printf("{");
    int printed = 0;
    for (int ph = 0; ph < NPHASE; ph++) {
        if (!run[ph])
            continue;
        double t0 = 1e300, t1 = 0;
        long errs = 0;
        int first = 0;
        for (int p = 0; p < nproc; p++) {
            if (sh->res[p].start[ph] < t0) t0 = sh->res[p].start[ph];
            if (sh->res[p].end[ph] > t1) t1 = sh->res[p].end[ph];
            errs += sh->res[p].errors[ph];
            if (!first) first = sh->res[p].first_errno[ph];
        }
        size_t n = (size_t)nproc * nfiles;
        float *l = lat + (size_t)ph * n;
        qsort(l, n, sizeof(float), cmp_float);
        printf("%s\"%s\": {\"ops_per_sec\": %.1f, \"seconds\": %.3f, \"p50_us\": %.1f, \"p99_us\": %.1f, "
               "\"max_us\": %.1f, \"errors\": %ld, \"first_errno\": \"%s\"}",
               printed++ ? ", " : "", phase_name[ph], n / (t1 - t0), t1 - t0, l[n / 2], l[n * 99 / 100], l[n - 1],
               errs, first ? strerror(first) : "");
    }
    printf("}\n");

    for (int p = 0; run[REMOVE] && p < (shared ? 1 : nproc); p++) {
        if (shared)
            snprintf(path, sizeof path, "%s/shared", dir);
        else
            snprintf(path, sizeof path, "%s/p%d", dir, p);
        /* Another instance may still have files there. */
        if (rmdir(path) != 0 && !(tag && errno == ENOTEMPTY))
            fprintf(stderr, "rmdir %s: %s\n", path, strerror(errno));
    }
    return 0;
}
