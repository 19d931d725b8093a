//! Whether a SQLite store's database file is still the one at its path.
//!
//! In WAL mode SQLite writes on to the file it opened after that file is
//! deleted or replaced (in rollback-journal mode it refuses, with
//! `SQLITE_READONLY_DBMOVED`): every answer is 2xx, and a process started
//! afterwards finds a fresh table, where the retry of a key answered
//! meanwhile runs its handler again. So a reservation checks, before its
//! read and once its write has committed, that the path still leads to the
//! file the store's connections opened; once it does not, every reservation
//! of the store answers [`StoreError::Unavailable`], and no handler runs
//! on a reservation that only the lost file holds.

use crate::store::StoreError;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

/// The file a store's connections opened, learnt when the store opens the
/// file (or, for a store over an application's pool, at its first
/// reservation's write), and whether its path has been found to lead
/// elsewhere since.
#[derive(Debug, Default)]
pub(crate) struct FileWatch {
    /// The path the store was given, when it is absolute (as `open` and
    /// `open_url` make it): what a process started afterwards opens (a
    /// symbolic link is followed at each check, so that one pointed at
    /// another file is noticed). A relative one is left out: it is read
    /// against whatever directory the process is in by then.
    given: Option<PathBuf>,
    /// `None` for a database with no file (in memory, temporary).
    opened: OnceLock<Option<Opened>>,
    moved: AtomicBool,
}

#[derive(Debug)]
struct Opened {
    path: PathBuf,
    identity: Identity,
}

/// A file's device and inode: what tells one file from another at a path.
type Identity = (u64, u64);

#[cfg(unix)]
fn identity(path: &std::path::Path) -> std::io::Result<Identity> {
    use std::os::unix::fs::MetadataExt as _;
    std::fs::metadata(path).map(|m| (m.dev(), m.ino()))
}

/// Elsewhere nothing tells two files at one path apart (and a file open in
/// a process cannot be deleted on Windows).
#[cfg(not(unix))]
fn identity(path: &std::path::Path) -> std::io::Result<Identity> {
    std::fs::metadata(path).map(|_| (0, 0))
}

impl FileWatch {
    /// A watch of the database a store's pool opens by the name `given`.
    pub(crate) fn of(given: &std::path::Path) -> Self {
        FileWatch {
            given: given.is_absolute().then(|| given.to_owned()),
            ..FileWatch::default()
        }
    }

    /// Whether the file is learnt (or known to be none).
    pub(crate) fn learnt(&self) -> bool {
        self.opened.get().is_some()
    }

    /// Learns the file the store's connections have open, by the name
    /// SQLite gives it (`""` for none; absolute, links resolved): the file
    /// at that name now, or, when none is there any more, a file deleted
    /// already. (Which file a connection has open cannot be asked of it:
    /// a file replaced between its opening and this is taken for the one.)
    /// Watched at the path the store was given when that leads to the same
    /// file (so that a link pointed elsewhere later is noticed), else at
    /// SQLite's name. A file whose path cannot be read now (a permission)
    /// is learnt later.
    pub(crate) fn learn(&self, name: &str) {
        if name.is_empty() {
            let _ = self.opened.set(None);
            return;
        }
        let named = PathBuf::from(name);
        let at = match identity(&named) {
            Ok(at) => at,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return self.learn_moved(named),
            Err(_) => return,
        };
        let path = match &self.given {
            Some(given) if identity(given).is_ok_and(|there| there == at) => given.clone(),
            _ => named,
        };
        let _ = self.opened.set(Some(Opened { path, identity: at }));
    }

    /// Learns that the file at `path` moved before it could be learnt.
    fn learn_moved(&self, path: PathBuf) {
        let _ = self.opened.set(Some(Opened {
            path,
            identity: (0, 0),
        }));
        if !self.moved.swap(true, Ordering::Relaxed) {
            self.log_moved();
        }
    }

    /// `Ok` while the path leads to the file the store opened (or nothing
    /// is known of it yet, or the path cannot be read: an error that tells
    /// nothing, such as a permission, is not taken for a move).
    pub(crate) fn check(&self) -> Result<(), StoreError> {
        let Some(Some(opened)) = self.opened.get() else {
            return Ok(());
        };
        if !self.moved.load(Ordering::Relaxed) {
            let moved = match identity(&opened.path) {
                Ok(now) => now != opened.identity,
                Err(e) => e.kind() == std::io::ErrorKind::NotFound,
            };
            if !moved {
                return Ok(());
            }
            if !self.moved.swap(true, Ordering::Relaxed) {
                self.log_moved();
            }
        }
        Err(StoreError::unavailable(format!(
            "the SQLite database file {} was deleted or replaced while this process had it open, so what \
             it writes would be lost; restart the process",
            opened.path.display()
        )))
    }

    fn log_moved(&self) {
        if let Some(Some(opened)) = self.opened.get() {
            tracing::error!(
                path = %opened.path.display(),
                "the SQLite database file was deleted or replaced while this process had it open: \
                 every reservation now answers 503; restart the process"
            );
        }
    }
}

/// The statement that names the file of the connection's main database.
pub(crate) const MAIN_FILE: &str = "SELECT file FROM pragma_database_list WHERE name = 'main'";
