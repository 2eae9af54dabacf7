//! Snapshot files on disk: written atomically (a temporary file, fsync, rename, fsync of the
//! directory) and read into a 16-byte-aligned buffer, so the archive inside is used in
//! place. On Linux the reads and writes go through io_uring, several 1 MiB chunks in flight
//! at once; where io_uring is unavailable (another OS, a kernel or seccomp profile without
//! it) the same operations use `std::fs`, and [`Backend`] says which one ran.
//!
//! # Invariants
//! 1. A reader sees the previous complete file or the new complete file, never a partial
//!    one (rename after fsync).
//! 2. Every buffer handed to the kernel outlives its operations: a call returns only after
//!    every submitted operation completed, errors included; if the ring stops taking
//!    submissions with operations still in the kernel's hands (never seen; retried for a
//!    second first), the ring, the file and the buffer are leaked rather than freed.

use rkyv::util::AlignedVec;
use std::fs::File;
use std::io;
use std::path::Path;

/// Which I/O path did the work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// io_uring.
    IoUring,
    /// `std::fs` (no io_uring here).
    Std,
    /// Not a file: received from a peer replica (NATS).
    Network,
}

impl Backend {
    /// A short name for logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::IoUring => "io_uring",
            Backend::Std => "std",
            Backend::Network => "nats",
        }
    }
}

/// Writes `bytes` to `path` atomically (invariant 1), readable by the owner only.
pub fn write_atomic<B: AsRef<[u8]>>(path: &Path, bytes: B) -> io::Result<Backend> {
    let tmp = path.with_extension("tmp");
    let file = create_private(&tmp)?;
    let mut abandoned = false;
    let written = uring::write_all(&file, bytes.as_ref(), &mut abandoned);
    if abandoned {
        // The kernel may still read it (invariant 2).
        std::mem::forget(bytes);
        std::mem::forget(file);
        return Err(io::Error::other("io_uring stopped taking submissions"));
    }
    let backend = match written {
        Some(r) => r.map(|()| Backend::IoUring)?,
        None => {
            std::io::Write::write_all(&mut &file, bytes.as_ref())?;
            file.sync_all()?;
            Backend::Std
        }
    };
    drop(file);
    std::fs::rename(&tmp, path)?;
    if let Some(dir) = path.parent() {
        // The rename itself must survive a crash.
        File::open(dir)?.sync_all()?;
    }
    Ok(backend)
}

/// Reads the whole file at `path` into an aligned buffer.
pub fn read(path: &Path) -> io::Result<(AlignedVec, Backend)> {
    let file = File::open(path)?;
    let len =
        usize::try_from(file.metadata()?.len()).map_err(|_| io::Error::other("file too large"))?;
    let mut buf = AlignedVec::<16>::with_capacity(len);
    buf.resize(len, 0);
    let mut abandoned = false;
    let got = uring::read_exact(&file, &mut buf, &mut abandoned);
    if abandoned {
        // The kernel may still write into it (invariant 2).
        std::mem::forget(buf);
        std::mem::forget(file);
        return Err(io::Error::other("io_uring stopped taking submissions"));
    }
    let backend = match got {
        Some(r) => r.map(|()| Backend::IoUring)?,
        None => {
            std::io::Read::read_exact(&mut &file, &mut buf)?;
            Backend::Std
        }
    };
    Ok((buf, backend))
}

fn create_private(path: &Path) -> io::Result<File> {
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create(true).truncate(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut opts, 0o600);
    opts.open(path)
}

#[cfg(target_os = "linux")]
mod uring {
    //! The io_uring path: chunks of [`CHUNK`] bytes, [`DEPTH`] in flight.

    use io_uring::{IoUring, opcode, squeue, types};
    use std::collections::VecDeque;
    use std::fs::File;
    use std::io;
    use std::os::fd::AsRawFd;

    const CHUNK: usize = 1 << 20;
    const DEPTH: u32 = 16;
    /// Consecutive failed submissions before giving up (about a second).
    const MAX_RETRIES: u32 = 1_000;

    /// `None`: no io_uring here (the caller falls back).
    fn ring() -> Option<IoUring> {
        match IoUring::new(DEPTH) {
            Ok(r) => Some(r),
            Err(e) => {
                tracing::debug!("io_uring unavailable, using std::fs: {e}");
                None
            }
        }
    }

    /// Runs `op(offset, len)` over `0..total` in chunks until every byte is done, requeueing
    /// short transfers; returns only once nothing is in flight (module invariant 2).
    fn run(
        ring: &mut IoUring,
        total: usize,
        op: impl Fn(usize, usize) -> squeue::Entry,
        eof_is_error: bool,
        abandoned: &mut bool,
    ) -> io::Result<()> {
        let mut todo: VecDeque<(usize, usize)> = (0..total)
            .step_by(CHUNK)
            .map(|off| (off, CHUNK.min(total - off)))
            .collect();
        let mut slots: Vec<Option<(usize, usize)>> = vec![None; DEPTH as usize];
        let mut in_flight = 0usize;
        let mut failed: Option<io::Error> = None;
        let mut retries = 0u32;
        loop {
            while failed.is_none() && in_flight < DEPTH as usize {
                let Some((off, len)) = todo.pop_front() else {
                    break;
                };
                let Some(slot) = slots.iter().position(Option::is_none) else {
                    todo.push_front((off, len));
                    break;
                };
                let entry = op(off, len).user_data(slot as u64);
                // SAFETY: the entry points into a buffer the caller keeps alive for the
                // whole call, and this function returns only after every submitted entry
                // completed (module invariant 2).
                let pushed = unsafe { ring.submission().push(&entry) };
                if pushed.is_err() {
                    todo.push_front((off, len));
                    break;
                }
                if let Some(s) = slots.get_mut(slot) {
                    *s = Some((off, len));
                }
                in_flight += 1;
            }
            if in_flight == 0 {
                return failed.map_or(Ok(()), Err);
            }
            match ring.submit_and_wait(1) {
                Ok(_) => retries = 0,
                // Transient: interrupted, or the completion queue is momentarily full.
                Err(e) if retries < MAX_RETRIES => {
                    retries += 1;
                    tracing::debug!("io_uring submit: {e}, retrying");
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                Err(e) => {
                    // Operations may still be in the kernel's hands: their buffers must
                    // stay alive, so the caller leaks them (invariant 2).
                    *abandoned = true;
                    return Err(e);
                }
            }
            let done: Vec<(u64, i32)> = ring
                .completion()
                .map(|c| (c.user_data(), c.result()))
                .collect();
            for (slot, res) in done {
                let Some((off, len)) = slots.get_mut(slot as usize).and_then(Option::take) else {
                    continue;
                };
                in_flight -= 1;
                match usize::try_from(res) {
                    Err(_) => {
                        failed.get_or_insert(io::Error::from_raw_os_error(-res));
                    }
                    Ok(0) if len > 0 => {
                        failed.get_or_insert(if eof_is_error {
                            io::Error::from(io::ErrorKind::UnexpectedEof)
                        } else {
                            io::Error::from(io::ErrorKind::WriteZero)
                        });
                    }
                    Ok(n) if n < len => todo.push_front((off + n, len - n)),
                    Ok(_) => {}
                }
            }
        }
    }

    /// Writes all of `bytes` at offset 0 and fsyncs; `None` if io_uring is unavailable.
    /// `abandoned`: operations may still be in flight; `bytes` must never be freed.
    pub fn write_all(file: &File, bytes: &[u8], abandoned: &mut bool) -> Option<io::Result<()>> {
        let mut ring = ring()?;
        let fd = types::Fd(file.as_raw_fd());
        let base = bytes.as_ptr();
        let written = run(
            &mut ring,
            bytes.len(),
            |off, len| {
                // `off + len <= bytes.len()` by construction of the chunks.
                opcode::Write::new(fd, base.wrapping_add(off), len as u32)
                    .offset(off as u64)
                    .build()
            },
            false,
            abandoned,
        );
        let synced = written.and_then(|()| fsync(&mut ring, fd, abandoned));
        if *abandoned {
            std::mem::forget(ring);
        }
        Some(synced)
    }

    /// One fsync through the ring.
    fn fsync(ring: &mut IoUring, fd: types::Fd, abandoned: &mut bool) -> io::Result<()> {
        let entry = opcode::Fsync::new(fd).build().user_data(0);
        // SAFETY: an fsync names no memory; it completes before this returns.
        unsafe { ring.submission().push(&entry) }
            .map_err(|_| io::Error::other("io_uring submission queue full"))?;
        let mut retries = 0;
        loop {
            match ring.submit_and_wait(1) {
                Ok(_) => break,
                Err(_) if retries < MAX_RETRIES => {
                    retries += 1;
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                Err(e) => {
                    *abandoned = true;
                    return Err(e);
                }
            }
        }
        match ring.completion().next().map(|c| c.result()) {
            Some(r) if r < 0 => Err(io::Error::from_raw_os_error(-r)),
            Some(_) => Ok(()),
            None => Err(io::Error::other(
                "io_uring fsync completed without a result",
            )),
        }
    }

    /// Fills `buf` from offset 0; `None` if io_uring is unavailable. `abandoned`: as for
    /// [`write_all`].
    pub fn read_exact(file: &File, buf: &mut [u8], abandoned: &mut bool) -> Option<io::Result<()>> {
        let mut ring = ring()?;
        let fd = types::Fd(file.as_raw_fd());
        let base = buf.as_mut_ptr();
        let r = run(
            &mut ring,
            buf.len(),
            |off, len| {
                opcode::Read::new(fd, base.wrapping_add(off), len as u32)
                    .offset(off as u64)
                    .build()
            },
            true,
            abandoned,
        );
        if *abandoned {
            std::mem::forget(ring);
        }
        Some(r)
    }
}

#[cfg(not(target_os = "linux"))]
mod uring {
    use std::fs::File;
    use std::io;

    pub fn write_all(_: &File, _: &[u8], _: &mut bool) -> Option<io::Result<()>> {
        None
    }

    pub fn read_exact(_: &File, _: &mut [u8], _: &mut bool) -> Option<io::Result<()>> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_and_reads_back_across_many_chunks() {
        let dir = std::env::temp_dir().join(format!("kvengine-file-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("x.kvs");
        // Not a multiple of the chunk size, and larger than DEPTH chunks.
        let bytes: Vec<u8> = (0..(17 << 20) + 12_345)
            .map(|i| (i * 7 % 251) as u8)
            .collect();
        let w = write_atomic(&path, bytes.clone()).unwrap();
        let (back, r) = read(&path).unwrap();
        assert_eq!(&back[..], &bytes[..]);
        assert_eq!(back.as_ptr() as usize % 16, 0);
        // Overwriting replaces the whole file.
        write_atomic(&path, b"short").unwrap();
        assert_eq!(&read(&path).unwrap().0[..], b"short");
        assert!(!path.with_extension("tmp").exists());
        eprintln!("backends: write {w:?}, read {r:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_missing_file_is_an_error_not_a_panic() {
        assert!(read(Path::new("/nonexistent/kvengine/x.kvs")).is_err());
    }
}
