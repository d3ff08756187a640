/* A disk quota that runs out, for a kernel without CONFIG_QUOTA (tests/integration/quota.py), and
 * other refusals a kernel cannot make on demand here (a read-only filesystem while files on it are
 * open for writing: `mount -o remount,ro` says EBUSY).
 *
 * Preloaded (LD_PRELOAD) into every process of a run. While the control file named by
 * HPCRL_EDQUOT_CTL exists, each of its lines is a directory that is "over quota": libc's calls that
 * would allocate space or an inode under it fail with errno EDQUOT, as a quota'd Lustre or ext4
 * returns it:
 *   - creating an entry: open/openat/creat with O_CREAT of a name that does not exist yet, mkdir,
 *     symlink (the inode quota);
 *   - writing to a file under it: write, pwrite, writev, pwritev, fallocate, sendfile,
 *     copy_file_range (the block quota; the file's path is read from /proc/self/fd).
 * A line may name another errno first, `ERRNAME /dir` (EDQUOT, ENOSPC, EROFS, EIO, EPERM, EACCES):
 * the same calls fail with it. EROFS also refuses what a read-only filesystem refuses beyond that:
 * opening an existing file for writing (O_WRONLY, O_RDWR, O_APPEND, O_TRUNC), rename, unlink, rmdir.
 * Everything else, and everything while the control file is absent, goes to libc unchanged (one
 * access(2) per call to look). The caller sees -1 and the errno from the very libc call it made
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

static int errno_named(const char *name, size_t len) {
    static const struct { const char *name; int value; } known[] = {
        {"EDQUOT", EDQUOT}, {"ENOSPC", ENOSPC}, {"EROFS", EROFS}, {"EIO", EIO},
        {"EPERM", EPERM}, {"EACCES", EACCES},
    };
    for (size_t i = 0; i < sizeof known / sizeof known[0]; i++)
        if (strlen(known[i].name) == len && strncmp(name, known[i].name, len) == 0) return known[i].value;
    return EDQUOT;
}

/* The errno of the first line of `dirs` that `path` is under (`[ERRNAME ]/dir`), or 0. */
static int under(const char *path, const char *dirs) {
    const char *d = dirs;
    while (*d) {
        const char *end = strchr(d, '\n');
        size_t len = end ? (size_t)(end - d) : strlen(d);
        int err = EDQUOT;
        if (len && d[0] != '/') {  /* `ERRNAME /dir` */
            const char *sp = memchr(d, ' ', len);
            if (sp) {
                err = errno_named(d, (size_t)(sp - d));
                len -= (size_t)(sp + 1 - d);
                d = sp + 1;
            }
        }
        while (len > 1 && d[len - 1] == '/') len--;
        if (len && strncmp(path, d, len) == 0 && (path[len] == 0 || path[len] == '/')) return err;
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

/* Each refuse_* returns the errno to fail with, or 0 to go on. */
static int refuse_fd(int fd) {
    char dirs[CTL_MAX], p[PATH_MAX];
    return over_quota(dirs) && fd_path(fd, p) ? under(p, dirs) : 0;
}

static int refuse_name(int dirfd, const char *path) {
    char dirs[CTL_MAX], p[PATH_MAX];
    return over_quota(dirs) && abs_path(dirfd, path, p) ? under(p, dirs) : 0;
}

/* open: a new name (O_CREAT) takes an inode; on a read-only filesystem any opening for writing fails. */
static int refuse_open(int dirfd, const char *path, int flags) {
    int writing = (flags & (O_WRONLY | O_RDWR | O_APPEND | O_TRUNC | O_CREAT)) != 0;
    if (!writing) return 0;
    int err = refuse_name(dirfd, path);
    if (!err || err == EROFS) return err;
    if (!(flags & O_CREAT)) return 0;
    struct stat st;  /* an existing file is opened (no new inode), as under a real quota */
    return syscall(SYS_newfstatat, dirfd, path, &st, 0) != 0 ? err : 0;
}

/* rename, unlink, rmdir: refused by a read-only filesystem only (a quota frees or moves space). */
static int refuse_change(int dirfd, const char *path) {
    int err = refuse_name(dirfd, path);
    return err == EROFS ? err : 0;
}

static int refuse_either(int fromfd, const char *from, int tofd, const char *to) {
    int err = refuse_change(fromfd, from);
    return err ? err : refuse_change(tofd, to);
}

#define REAL(name) static __typeof__(name) *real_##name; if (!real_##name) real_##name = dlsym(RTLD_NEXT, #name)
/* Fail the call with the errno `expr` gives (0: go on). */
#define FAIL_IF(expr) do { int e_ = (expr); if (e_) { errno = e_; return -1; } } while (0)

static mode_t mode_of(int flags, va_list ap) {
    return (flags & (O_CREAT | O_TMPFILE)) ? (mode_t)va_arg(ap, int) : 0;
}

int open(const char *path, int flags, ...) {
    va_list ap; va_start(ap, flags); mode_t m = mode_of(flags, ap); va_end(ap);
    REAL(open);
    FAIL_IF(refuse_open(AT_FDCWD, path, flags));
    return real_open(path, flags, m);
}
int open64(const char *path, int flags, ...) {
    va_list ap; va_start(ap, flags); mode_t m = mode_of(flags, ap); va_end(ap);
    REAL(open64);
    FAIL_IF(refuse_open(AT_FDCWD, path, flags));
    return real_open64(path, flags, m);
}
int openat(int dirfd, const char *path, int flags, ...) {
    va_list ap; va_start(ap, flags); mode_t m = mode_of(flags, ap); va_end(ap);
    REAL(openat);
    FAIL_IF(refuse_open(dirfd, path, flags));
    return real_openat(dirfd, path, flags, m);
}
int openat64(int dirfd, const char *path, int flags, ...) {
    va_list ap; va_start(ap, flags); mode_t m = mode_of(flags, ap); va_end(ap);
    REAL(openat64);
    FAIL_IF(refuse_open(dirfd, path, flags));
    return real_openat64(dirfd, path, flags, m);
}
int creat(const char *path, mode_t m) {
    REAL(creat);
    FAIL_IF(refuse_open(AT_FDCWD, path, O_CREAT | O_WRONLY | O_TRUNC));
    return real_creat(path, m);
}
int creat64(const char *path, mode_t m) {
    REAL(creat64);
    FAIL_IF(refuse_open(AT_FDCWD, path, O_CREAT | O_WRONLY | O_TRUNC));
    return real_creat64(path, m);
}
int mkdir(const char *path, mode_t m) {
    REAL(mkdir);
    FAIL_IF(refuse_name(AT_FDCWD, path));
    return real_mkdir(path, m);
}
int mkdirat(int dirfd, const char *path, mode_t m) {
    REAL(mkdirat);
    FAIL_IF(refuse_name(dirfd, path));
    return real_mkdirat(dirfd, path, m);
}
int symlink(const char *target, const char *path) {
    REAL(symlink);
    FAIL_IF(refuse_name(AT_FDCWD, path));
    return real_symlink(target, path);
}
ssize_t write(int fd, const void *buf, size_t n) {
    REAL(write);
    FAIL_IF(n ? refuse_fd(fd) : 0);
    return real_write(fd, buf, n);
}
ssize_t pwrite(int fd, const void *buf, size_t n, off_t off) {
    REAL(pwrite);
    FAIL_IF(n ? refuse_fd(fd) : 0);
    return real_pwrite(fd, buf, n, off);
}
ssize_t pwrite64(int fd, const void *buf, size_t n, off64_t off) {
    REAL(pwrite64);
    FAIL_IF(n ? refuse_fd(fd) : 0);
    return real_pwrite64(fd, buf, n, off);
}
ssize_t writev(int fd, const struct iovec *iov, int cnt) {
    REAL(writev);
    FAIL_IF(cnt ? refuse_fd(fd) : 0);
    return real_writev(fd, iov, cnt);
}
ssize_t pwritev(int fd, const struct iovec *iov, int cnt, off_t off) {
    REAL(pwritev);
    FAIL_IF(cnt ? refuse_fd(fd) : 0);
    return real_pwritev(fd, iov, cnt, off);
}
ssize_t pwritev64(int fd, const struct iovec *iov, int cnt, off64_t off) {
    REAL(pwritev64);
    FAIL_IF(cnt ? refuse_fd(fd) : 0);
    return real_pwritev64(fd, iov, cnt, off);
}
int fallocate(int fd, int mode, off_t off, off_t len) {
    REAL(fallocate);
    FAIL_IF(refuse_fd(fd));
    return real_fallocate(fd, mode, off, len);
}
int fallocate64(int fd, int mode, off64_t off, off64_t len) {
    REAL(fallocate64);
    FAIL_IF(refuse_fd(fd));
    return real_fallocate64(fd, mode, off, len);
}
int posix_fallocate(int fd, off_t off, off_t len) {
    REAL(posix_fallocate);
    int e = refuse_fd(fd);
    if (e) return e;  /* returns the error, as posix_fallocate does */
    return real_posix_fallocate(fd, off, len);
}
int posix_fallocate64(int fd, off64_t off, off64_t len) {
    REAL(posix_fallocate64);
    int e = refuse_fd(fd);
    if (e) return e;
    return real_posix_fallocate64(fd, off, len);
}
ssize_t sendfile(int out, int in, off_t *off, size_t n) {
    REAL(sendfile);
    FAIL_IF(n ? refuse_fd(out) : 0);
    return real_sendfile(out, in, off, n);
}
ssize_t sendfile64(int out, int in, off64_t *off, size_t n) {
    REAL(sendfile64);
    FAIL_IF(n ? refuse_fd(out) : 0);
    return real_sendfile64(out, in, off, n);
}
ssize_t copy_file_range(int in, off64_t *in_off, int out, off64_t *out_off, size_t n, unsigned int f) {
    REAL(copy_file_range);
    FAIL_IF(n ? refuse_fd(out) : 0);
    return real_copy_file_range(in, in_off, out, out_off, n, f);
}
int rename(const char *from, const char *to) {
    REAL(rename);
    FAIL_IF(refuse_either(AT_FDCWD, from, AT_FDCWD, to));
    return real_rename(from, to);
}
int renameat(int fromfd, const char *from, int tofd, const char *to) {
    REAL(renameat);
    FAIL_IF(refuse_either(fromfd, from, tofd, to));
    return real_renameat(fromfd, from, tofd, to);
}
int unlink(const char *path) {
    REAL(unlink);
    FAIL_IF(refuse_change(AT_FDCWD, path));
    return real_unlink(path);
}
int unlinkat(int dirfd, const char *path, int flags) {
    REAL(unlinkat);
    FAIL_IF(refuse_change(dirfd, path));
    return real_unlinkat(dirfd, path, flags);
}
int rmdir(const char *path) {
    REAL(rmdir);
    FAIL_IF(refuse_change(AT_FDCWD, path));
    return real_rmdir(path);
}
