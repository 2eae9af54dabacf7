//! Stopping on SIGINT and SIGTERM, and never on SIGHUP: `kvengine serve` reloads its config
//! file on SIGHUP (a handler that also stopped on it raced the reload and won).

use anyhow::{Context, Result};
use tokio::sync::watch;

/// A channel that turns `true` on SIGINT or SIGTERM. Both are watched from the moment this
/// returns, before any runtime of the command exists.
pub fn stop_channel() -> Result<watch::Receiver<bool>> {
    let (tx, rx) = watch::channel(false);
    let on_int = tx.clone();
    ctrlc::set_handler(move || {
        let _ = on_int.send(true);
    })
    .context("cannot install the SIGINT handler")?;
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        // A one-thread runtime of its own, with the handler installed here (so a SIGTERM
        // that comes early is not the default action, the end of the process).
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("cannot start the SIGTERM watcher")?;
        let mut term = {
            let _entered = rt.enter();
            signal(SignalKind::terminate()).context("cannot install the SIGTERM handler")?
        };
        std::thread::Builder::new()
            .name("kvengine-sigterm".into())
            .spawn(move || {
                rt.block_on(async move {
                    if term.recv().await.is_some() {
                        let _ = tx.send(true);
                    }
                });
            })
            .context("cannot start the SIGTERM watcher")?;
    }
    Ok(rx)
}
