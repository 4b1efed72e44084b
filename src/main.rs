//! The `shoal` binary: parse the command line, then run a node, a benchmark or a client
//! command.

use std::process::ExitCode;

use clap::{CommandFactory, Parser};
use shoal::cli::CliError;
use shoal::config::{Cli, Command, LogFormat, Output, ServeConfig};
use shoal::node::StartError;
use tracing_subscriber::EnvFilter;

/// mimalloc instead of the system allocator: fewer CPU cycles per request and less memory per
/// cached item than glibc's malloc (see `tests/perf/README.md`).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The allocator's options, where the operator set none (`MIMALLOC_*` variables win): collect
/// the thread heaps every 100 slow-path allocations instead of 10,000, keep no full pages per
/// size class, and return freed pages after 1 ms instead of 10. Eviction churn between small
/// and 64 KiB values peaked at 100–106% of `--memory-limit` with mimalloc's defaults and at
/// 82–86% with these, and 100-byte GETs and PUTs cost the same CPU within the noise
/// (`tests/perf/README.md`, "The allocator's options"). The numbers are mimalloc's own
/// (`mi_option_e` in its `mimalloc.h`): the sys crate names only the stable ones.
#[allow(unsafe_code)]
fn tune_allocator() {
    const PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;
    const GENERIC_COLLECT: libmimalloc_sys::mi_option_t = 34;
    const PAGE_FULL_RETAIN: libmimalloc_sys::mi_option_t = 36;
    for (variable, option, value) in [
        ("MIMALLOC_PURGE_DELAY", PURGE_DELAY, 1),
        ("MIMALLOC_GENERIC_COLLECT", GENERIC_COLLECT, 100),
        ("MIMALLOC_PAGE_FULL_RETAIN", PAGE_FULL_RETAIN, 0),
    ] {
        if std::env::var_os(variable).is_none() {
            // SAFETY: a plain setter of a number, called before any other thread exists (it
            // is not thread-safe), with an option mimalloc defines.
            unsafe { libmimalloc_sys::mi_option_set(option, value) };
        }
    }
}

fn main() -> ExitCode {
    tune_allocator();
    // Usage errors exit with 2 (clap's convention, and the documented one).
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(config) => serve(config).map_err(CliError::from),
        Command::Bench(args) => {
            let output = args.output;
            shoal::bench::run(args)
                .map(|report| match output {
                    Output::Table => print!("{}", shoal::bench::table(&report)),
                    Output::Json => println!("{}", serde_json::to_string_pretty(&report).unwrap_or_default()),
                })
                .map_err(CliError::from)
        }
        Command::Completions(args) => {
            clap_complete::generate(args.shell, &mut Cli::command(), "shoal", &mut std::io::stdout());
            Ok(())
        }
        command => client_runtime().map_err(CliError::from).and_then(|rt| rt.block_on(shoal::cli::run(command))),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(e.exit)
        }
    }
}

/// The runtime of a client command: one thread is plenty.
fn client_runtime() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))
}

/// The runtime of a node: multi-threaded, `threads` workers (default: one per core).
fn server_runtime(threads: Option<usize>) -> Result<tokio::runtime::Runtime, String> {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = threads {
        builder.worker_threads(n);
    }
    builder.enable_all().build().map_err(|e| format!("cannot start the runtime: {e}"))
}

/// Runs a node until Ctrl-C, SIGTERM, or it leaves the cluster.
fn serve(config: ServeConfig) -> Result<(), String> {
    let config = config.resolved();
    init_logs(config.log_format);
    config.validate().map_err(|e| format!("invalid configuration: {e}"))?;

    server_runtime(config.worker_threads)?.block_on(async {
        let mut config = config;
        loop {
            let rejoin = match shoal::node::start(config.clone()).await {
                Ok(node) => {
                    let signalled = tokio::select! {
                        _ = shutdown_signal() => true,
                        _ = node.stopped() => false,
                    };
                    let rejoin = node.rejoin().filter(|_| !signalled);
                    if signalled {
                        node.stop_on_signal(config.restart_window, config.drain_timeout).await;
                    } else {
                        node.shutdown().await;
                    }
                    match rejoin {
                        Some(join) => join,
                        None => return Ok(()),
                    }
                }
                Err(StartError::Failed { node_id, join }) => {
                    tracing::warn!(node_id, "the cluster failed this node while it was down");
                    join
                }
                // Printed once, by `main`, as every command's error is.
                Err(e) => return Err(e.to_string()),
            };
            // A failed node discards its stale data and Raft state and joins as a new member.
            shoal::node::discard_data_dir(&config.data_dir).map_err(|e| e.to_string())?;
            tracing::info!(join = ?rejoin, "rejoining the cluster as a new member");
            config.join = rejoin;
        }
    })
}

/// Logs to standard error, filtered by RUST_LOG (default `info,openraft=error,openraft::replication=off`:
/// openraft's routine complaints, such as every failed append to a member that is down, stay out):
/// text lines, coloured only on a terminal, or one JSON object per line.
fn init_logs(format: LogFormat) {
    use std::io::IsTerminal;
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("info,openraft=error,openraft::replication=off"));
    let logs = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        LogFormat::Text => logs.with_ansi(std::io::stderr().is_terminal()).init(),
        LogFormat::Json => logs.json().with_current_span(false).init(),
    }
}

/// Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => return std::future::pending().await,
    };
    tokio::select! {
        _ = ctrl_c => {}
        _ = term.recv() => {}
    }
}
