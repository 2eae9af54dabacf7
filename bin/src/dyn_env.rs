//! Dynamo's environment variable names for the settings kvengine shares with its router
//! (docs/api.md "Dynamo's names"), so a deployment written for `dynamo.frontend` keeps its
//! environment. Each `DYN_*` name is copied to its `KVENGINE_*` name before the command
//! line is parsed; a `KVENGINE_*` variable that is set wins, and a flag wins over both.

/// `(Dynamo's name, kvengine's name)`.
pub const ALIASES: [(&str, &str); 6] = [
    ("DYN_ROUTER_MODE", "KVENGINE_ROUTER_MODE"),
    ("DYN_ROUTER_TEMPERATURE", "KVENGINE_ROUTER_TEMPERATURE"),
    (
        "DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT",
        "KVENGINE_KV_OVERLAP_SCORE_WEIGHT",
    ),
    ("DYN_ROUTER_USE_KV_EVENTS", "KVENGINE_KV_EVENTS"),
    ("DYN_HTTP_HOST", "KVENGINE_HTTP_HOST"),
    ("DYN_HTTP_PORT", "KVENGINE_HTTP_PORT"),
];

/// Copies each set `DYN_*` variable to its unset `KVENGINE_*` name.
///
/// Must run first in `main`, before any thread exists (it sets environment variables).
pub fn apply() {
    for (dynamo, ours) in ALIASES {
        if std::env::var_os(ours).is_none()
            && let Some(value) = std::env::var_os(dynamo)
        {
            // SAFETY: called at the top of `main`, before the process starts any thread, so
            // nothing can read the environment concurrently (the reason `set_var` is
            // unsafe).
            unsafe { std::env::set_var(ours, value) };
        }
    }
}
