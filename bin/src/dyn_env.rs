//! Other names for kvengine's environment variables: Dynamo's, for the settings kvengine
//! shares with its router (docs/api.md "Dynamo's names"), so a deployment written for
//! `dynamo.frontend` keeps its environment; and kvengine's own former names, so a renamed
//! setting keeps working. Each other name is copied to its `KVENGINE_*` name before the
//! command line is parsed; a `KVENGINE_*` variable that is set wins, and a flag wins over
//! both.

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

/// `(former name, current name)`: kvengine's own renamed variables. Their flags keep the
/// former name as a hidden alias, and the config file takes it too.
pub const FORMER: [(&str, &str); 2] = [
    // The trunk's "hub" became a junction (issue 30): `--hub-fanout`.
    ("KVENGINE_HUB_FANOUT", "KVENGINE_JUNCTION_FANOUT"),
    (
        "KVENGINE_BENCH_HUB_FANOUT",
        "KVENGINE_BENCH_JUNCTION_FANOUT",
    ),
];

/// Copies each set `DYN_*` (or former) variable to its unset `KVENGINE_*` name.
///
/// Must run first in `main`, before any thread exists (it sets environment variables).
pub fn apply() {
    for (other, ours) in ALIASES.into_iter().chain(FORMER) {
        if std::env::var_os(ours).is_none()
            && let Some(value) = std::env::var_os(other)
        {
            // SAFETY: called at the top of `main`, before the process starts any thread, so
            // nothing can read the environment concurrently (the reason `set_var` is
            // unsafe).
            unsafe { std::env::set_var(ours, value) };
        }
    }
}
