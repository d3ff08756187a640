/* A disk quota that runs out, for a kernel without CONFIG_QUOTA (tests/integration/quota.py).
 *
 * Preloaded (LD_PRELOAD) into every process of a run. While the control file named by
 * HPCRL_EDQUOT_CTL exists, each of its lines is a directory that is "over quota": libc's calls that
 * would allocate space or an inode under it fail with errno EDQUOT, as a quota'd Lustre or ext4
 * returns it:
 *   - creating an entry: open/openat/creat with O_CREAT of a name that does not exist yet, mkdir,
 *     symlink (the inode quota);
 *   - writing to a file under it: write, pwrite, writev, pwritev, fallocate, sendfile,
 *     copy_file_range (the block quota; the file's path is read from /proc/self/fd).
 * Everything else, and everything while the control file is absent, goes to libc unchanged (one
 * access(2) per call to look). The caller sees -1 and errno EDQUOT from the very libc call it made
 * (Python's os.write / FileIO, Rust's std::fs, libstdc++'s filebuf all call these symbols).
 * Not seen: glibc's own internal calls (stdio's fwrite flushing through __write). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#define CTL_MAX 4096

/* The directories over quota now (newline-separated, into buf), or 0 when none. Raw syscalls only:
 * these must not re-enter the wrappers below. */
static int over_quota(char *buf) {
    const char *ctl = getenv("HPCRL_EDQUOT_CTL");
    if (!ctl || syscall(SYS_faccessat, AT_FDCWD, ctl, F_OK, 0) != 0) return 0;
    int fd = (int)syscall(SYS_openat, AT_FDCWD, ctl, O_RDONLY | O_CLOEXEC, 0);
    if (fd < 0) return 0;
    long n = syscall(SYS_read, fd, buf, CTL_MAX - 1);
    syscall(SYS_close, fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    return 1;
}

static int under(const char *path, const char *dirs) {
    const char *d = dirs;
    while (*d) {
        const char *end = strchr(d, '\n');
        size_t len = end ? (size_t)(end - d) : strlen(d);
        while (len > 1 && d[len - 1] == '/') len--;
        if (len && strncmp(path, d, len) == 0 && (path[len] == 0 || path[len] == '/')) return 1;
        if (!end) break;
        d = end + 1;
    }
    return 0;
}

static int fd_path(int fd, char *out) {
    char link[64];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    long n = syscall(SYS_readlink, link, out, PATH_MAX - 1);
    if (n <= 0) return 0;
    out[n] = 0;
    return 1;
}

/* The absolute name of `path` relative to `dirfd` (no symlinks resolved, as the caller wrote it). */
static int abs_path(int dirfd, const char *path, char *out) {
    char base[PATH_MAX];
    if (!path) return 0;
    if (path[0] == '/') {
        snprintf(out, PATH_MAX, "%s", path);
        return 1;
    }
    if (dirfd == AT_FDCWD) {
        if (syscall(SYS_getcwd, base, sizeof base) <= 0) return 0;
    } else if (!fd_path(dirfd, base)) {
        return 0;
    }
    snprintf(out, PATH_MAX, "%s/%s", base, path);
    return 1;
}

static int refuse_fd(int fd) {
    char dirs[CTL_MAX], p[PATH_MAX];
    return over_quota(dirs) && fd_path(fd, p) && under(p, dirs);
}

static int refuse_name(int dirfd, const char *path) {
    char dirs[CTL_MAX], p[PATH_MAX];
    return over_quota(dirs) && abs_path(dirfd, path, p) && under(p, dirs);
}

static int refuse_create(int dirfd, const char *path, int flags) {
    if (!(flags & O_CREAT)) return 0;
    if (!refuse_name(dirfd, path)) return 0;
    struct stat st;  /* an existing file is opened (no new inode), as under a real quota */
    return syscall(SYS_newfstatat, dirfd, path, &st, 0) != 0;
}

#define REAL(name) static __typeof__(name) *real_##name; if (!real_##name) real_##name = dlsym(RTLD_NEXT, #name)
#define EDQUOT_IF(cond) do { if (cond) { errno = EDQUOT; return -1; } } while (0)

static mode_t mode_of(int flags, va_list ap) {
    return (flags & (O_CREAT | O_TMPFILE)) ? (mode_t)va_arg(ap, int) : 0;
}

int open(const char *path, int flags, ...) {
    va_list ap; va_start(ap, flags); mode_t m = mode_of(flags, ap); va_end(ap);
    REAL(open);
    EDQUOT_IF(refuse_create(AT_FDCWD, path, flags));
    return real_open(path, flags, m);
}
int open64(const char *path, int flags, ...) {
    va_list ap; va_start(ap, flags); mode_t m = mode_of(flags, ap); va_end(ap);
    REAL(open64);
    EDQUOT_IF(refuse_create(AT_FDCWD, path, flags));
    return real_open64(path, flags, m);
}
int openat(int dirfd, const char *path, int flags, ...) {
    va_list ap; va_start(ap, flags); mode_t m = mode_of(flags, ap); va_end(ap);
    REAL(openat);
    EDQUOT_IF(refuse_create(dirfd, path, flags));
    return real_openat(dirfd, path, flags, m);
}
int openat64(int dirfd, const char *path, int flags, ...) {
    va_list ap; va_start(ap, flags); mode_t m = mode_of(flags, ap); va_end(ap);
    REAL(openat64);
    EDQUOT_IF(refuse_create(dirfd, path, flags));
    return real_openat64(dirfd, path, flags, m);
}
int creat(const char *path, mode_t m) {
    REAL(creat);
    EDQUOT_IF(refuse_create(AT_FDCWD, path, O_CREAT));
    return real_creat(path, m);
}
int creat64(const char *path, mode_t m) {
    REAL(creat64);
    EDQUOT_IF(refuse_create(AT_FDCWD, path, O_CREAT));
    return real_creat64(path, m);
}
int mkdir(const char *path, mode_t m) {
    REAL(mkdir);
    EDQUOT_IF(refuse_name(AT_FDCWD, path));
    return real_mkdir(path, m);
}
int mkdirat(int dirfd, const char *path, mode_t m) {
    REAL(mkdirat);
    EDQUOT_IF(refuse_name(dirfd, path));
    return real_mkdirat(dirfd, path, m);
}
int symlink(const char *target, const char *path) {
    REAL(symlink);
    EDQUOT_IF(refuse_name(AT_FDCWD, path));
    return real_symlink(target, path);
}
ssize_t write(int fd, const void *buf, size_t n) {
    REAL(write);
    EDQUOT_IF(n && refuse_fd(fd));
    return real_write(fd, buf, n);
}
ssize_t pwrite(int fd, const void *buf, size_t n, off_t off) {
    REAL(pwrite);
    EDQUOT_IF(n && refuse_fd(fd));
    return real_pwrite(fd, buf, n, off);
}
ssize_t pwrite64(int fd, const void *buf, size_t n, off64_t off) {
    REAL(pwrite64);
    EDQUOT_IF(n && refuse_fd(fd));
    return real_pwrite64(fd, buf, n, off);
}
ssize_t writev(int fd, const struct iovec *iov, int cnt) {
    REAL(writev);
    EDQUOT_IF(cnt && refuse_fd(fd));
    return real_writev(fd, iov, cnt);
}
ssize_t pwritev(int fd, const struct iovec *iov, int cnt, off_t off) {
    REAL(pwritev);
    EDQUOT_IF(cnt && refuse_fd(fd));
    return real_pwritev(fd, iov, cnt, off);
}
ssize_t pwritev64(int fd, const struct iovec *iov, int cnt, off64_t off) {
    REAL(pwritev64);
    EDQUOT_IF(cnt && refuse_fd(fd));
    return real_pwritev64(fd, iov, cnt, off);
}
int fallocate(int fd, int mode, off_t off, off_t len) {
    REAL(fallocate);
    EDQUOT_IF(refuse_fd(fd));
    return real_fallocate(fd, mode, off, len);
}
int fallocate64(int fd, int mode, off64_t off, off64_t len) {
    REAL(fallocate64);
    EDQUOT_IF(refuse_fd(fd));
    return real_fallocate64(fd, mode, off, len);
}
int posix_fallocate(int fd, off_t off, off_t len) {
    REAL(posix_fallocate);
    if (refuse_fd(fd)) return EDQUOT;  /* returns the error, as posix_fallocate does */
    return real_posix_fallocate(fd, off, len);
}
int posix_fallocate64(int fd, off64_t off, off64_t len) {
    REAL(posix_fallocate64);
    if (refuse_fd(fd)) return EDQUOT;
    return real_posix_fallocate64(fd, off, len);
}
ssize_t sendfile(int out, int in, off_t *off, size_t n) {
    REAL(sendfile);
    EDQUOT_IF(n && refuse_fd(out));
    return real_sendfile(out, in, off, n);
}
ssize_t sendfile64(int out, int in, off64_t *off, size_t n) {
    REAL(sendfile64);
    EDQUOT_IF(n && refuse_fd(out));
    return real_sendfile64(out, in, off, n);
}
ssize_t copy_file_range(int in, off64_t *in_off, int out, off64_t *out_off, size_t n, unsigned int f) {
    REAL(copy_file_range);
    EDQUOT_IF(n && refuse_fd(out));
    return real_copy_file_range(in, in_off, out, out_off, n, f);
}
