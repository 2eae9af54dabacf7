//! The `kvengine` command line: argument parsing and wiring only.
//!
//! * `kvengine [--cores N]` (or `kvengine serve`): the router: engine, ZMQ/QUIC ingest and
//!   the HTTP edge, up until SIGINT/SIGTERM (see `serve.rs`).
//! * `kvengine publish`: send KV events over QUIC (see `publish.rs`).
//! * `kvengine demo`: KV-aware routing on a simulated cluster (see `demo.rs`).
//! * `kvengine sim`: simulated vLLM workers (OpenAI HTTP + ZMQ KV events) to route to (see
//!   `sim.rs`).
//! * `kvengine bench indexer|ingest`: the benchmarks (see `bench.rs`).
//!
//! # Invariants
//! 1. Every flag can also be set by a `KVENGINE_*` environment variable; the flag wins.
//! 2. A bad flag exits non-zero with a message naming it.

mod bench;
mod bench_peers;
mod config_file;
mod demo;
mod disagg_args;
mod dyn_env;
mod fds;
mod logging;
mod memory;
mod publish;
mod replicas;
mod serve;
mod signals;
mod sim;
mod warm;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// kvengine: a KV-cache-aware router for LLM inference clusters.
#[derive(Debug, Parser)]
#[command(
    name = "kvengine",
    version,
    about,
    args_conflicts_with_subcommands = true
)]
struct Cli {
    /// Engine settings when no subcommand is given (same as `kvengine serve`).
    #[command(flatten)]
    serve: serve::ServeArgs,
    #[command(subcommand)]
    command: Option<Command>,
    /// Let the kernel back this process's memory with transparent huge pages, as the system
    /// allows. Off by default: huge pages make the resident set move in 2 MiB steps and keep
    /// memory the allocator gave back (see docs/api.md, "Bounds").
    #[arg(long, global = true, env = "KVENGINE_TRANSPARENT_HUGE_PAGES")]
    transparent_huge_pages: bool,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the router: engine, ingest transports and HTTP edge (the default).
    Serve(Box<serve::ServeArgs>),
    /// Route a workload over simulated GPU workers with each routing mode and compare the
    /// prefix-cache hit rates (no cluster, GPU or data file needed).
    Demo(demo::DemoArgs),
    /// Benchmarks (`kvengine bench indexer`, `kvengine bench ingest`).
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// Send KV events from a JSON-lines file to a router over QUIC.
    Publish(publish::PublishArgs),
    /// Run simulated vLLM workers (OpenAI-compatible HTTP, vLLM KV events over ZMQ) that
    /// kvengine can route to, no GPU needed.
    Sim(sim::SimArgs),
}

fn main() -> ExitCode {
    dyn_env::apply();
    // After Dynamo's names: the environment beats the file.
    if let Some(path) = config_file::path_from_args() {
        match config_file::load(&path) {
            Ok(file) => config_file::apply(&file),
            Err(e) => {
                eprintln!("kvengine: error: {e:#}");
                return ExitCode::FAILURE;
            }
        }
    }
    let cli = Cli::parse();
    memory::configure(cli.transparent_huge_pages);
    fds::raise_limit();
    let result = match cli.command {
        None => serve::run(&cli.serve),
        Some(Command::Serve(args)) => serve::run(&args),
        Some(Command::Demo(args)) => demo::run(&args),
        Some(Command::Bench(cmd)) => bench::run_bench(&cmd),
        Some(Command::Publish(args)) => publish::run(&args),
        Some(Command::Sim(args)) => sim::run(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvengine: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn no_subcommand_means_serve() {
        let cli = Cli::try_parse_from(["kvengine", "--cores", "3"]).unwrap();
        assert!(cli.command.is_none());
        assert_eq!(cli.serve.cores, Some(3));
        let cli = Cli::try_parse_from(["kvengine", "demo", "--requests", "5"]).unwrap();
        assert!(matches!(cli.command, Some(Command::Demo(_))));
        assert!(Cli::try_parse_from(["kvengine", "--cores", "0"]).is_err());
    }

    #[test]
    fn renamed_flags_keep_their_former_names() {
        let fanout = |a: &[&str]| {
            let mut v = vec!["kvengine"];
            v.extend_from_slice(a);
            Cli::try_parse_from(v).unwrap().serve.junction_fanout
        };
        assert_eq!(fanout(&["--junction-fanout", "5"]), 5);
        assert_eq!(fanout(&["--hub-fanout", "5"]), 5);
        let cli = Cli::try_parse_from(["kvengine", "serve", "--hub-fanout", "6"]).unwrap();
        assert!(matches!(cli.command, Some(Command::Serve(a)) if a.junction_fanout == 6));
        // A former variable name maps to a variable some flag reads.
        let mut envs = Vec::new();
        let mut cmds = vec![Cli::command()];
        while let Some(cmd) = cmds.pop() {
            envs.extend(
                cmd.get_arguments()
                    .filter_map(|a| a.get_env())
                    .map(|e| e.to_owned()),
            );
            cmds.extend(cmd.get_subcommands().cloned());
        }
        for (_, current) in dyn_env::FORMER {
            assert!(
                envs.iter().any(|e| e == current),
                "{current} is no flag's variable"
            );
        }
    }

    #[test]
    fn an_open_control_plane_is_warned_about_and_the_edge_bounds_default_sanely() {
        let args = |a: &[&str]| {
            let mut v = vec!["kvengine"];
            v.extend_from_slice(a);
            Cli::try_parse_from(v).unwrap().serve
        };
        let open = args(&[]);
        let public: std::net::SocketAddr = "0.0.0.0:8000".parse().unwrap();
        let local: std::net::SocketAddr = "127.0.0.1:8000".parse().unwrap();
        assert!(serve::control_plane_warning(&open, public).is_some());
        assert!(serve::control_plane_warning(&open, local).is_none());
        let token = args(&["--admin-token", "s3cret"]);
        assert!(serve::control_plane_warning(&token, public).is_none());
        // The body limit fits the prompt cap; both can be set.
        assert_eq!(open.body_limit(), transport::http::DEFAULT_MAX_BODY_BYTES);
        assert_eq!(
            transport::http::DEFAULT_MAX_BODY_BYTES,
            transport::http::body_limit_for(transport::http::DEFAULT_MAX_PROMPT_TOKENS)
        );
        let capped = args(&["--max-prompt-tokens", "4000000"]);
        assert!(capped.body_limit() >= 4_000_000 * 11);
        assert_eq!(args(&["--max-body-bytes", "1000"]).body_limit(), 1000);
        let limits = open.conn_limits();
        assert_eq!(limits, transport::http::conn::ConnLimits::default());
        assert_eq!(
            open.limits().max_reservations_per_client,
            Some(engine::router::reservations::DEFAULT_MAX_RESERVATIONS_PER_CLIENT)
        );
    }
}
