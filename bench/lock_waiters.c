/* Lock hand-off through a mount: the parent takes a write lock on FILE (fcntl F_SETLKW),
 * forks N children that each open FILE and wait for the same lock (F_SETLKW), then take it
 * and let it go at once, and exit; one second after the forks the parent lets its lock go
 * and measures how long until every child is through. Prints one JSON line.
 * Usage: lock_waiters FILE N */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static int lock(int fd, short type, int cmd) {
  struct flock f = {0};
  f.l_type = type;
  f.l_whence = SEEK_SET;
  return fcntl(fd, cmd, &f);
}

int main(int argc, char **argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: %s FILE N\n", argv[0]);
    return 2;
  }
  const char *path = argv[1];
  int n = atoi(argv[2]);
  int fd = open(path, O_CREAT | O_RDWR, 0644);
  if (fd < 0 || lock(fd, F_WRLCK, F_SETLKW)) {
    perror("parent lock");
    return 1;
  }
  for (int i = 0; i < n; i++) {
    pid_t pid = fork();
    if (pid < 0) {
      perror("fork");
      return 1;
    }
    if (pid == 0) {
      int c = open(path, O_RDWR);
      if (c < 0 || lock(c, F_WRLCK, F_SETLKW) || lock(c, F_UNLCK, F_SETLK))
        _exit(1);
      _exit(0);
    }
  }
  sleep(1);
  struct timespec a, b;
  clock_gettime(CLOCK_MONOTONIC, &a);
  if (lock(fd, F_UNLCK, F_SETLK)) perror("unlock");
  int failed = 0;
  for (int i = 0; i < n; i++) {
    int st;
    if (wait(&st) < 0 || !WIFEXITED(st) || WEXITSTATUS(st)) failed++;
  }
  clock_gettime(CLOCK_MONOTONIC, &b);
  printf("{\"waiters\": %d, \"failed\": %d, \"seconds_after_unlock\": %.3f}\n", n, failed,
         (b.tv_sec - a.tv_sec) + (b.tv_nsec - a.tv_nsec) / 1e9);
  return failed != 0;
}
