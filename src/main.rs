//! The `shoal` binary: parse the command line, then run a node, a benchmark or a client
//! command.

use std::process::ExitCode;

use clap::Parser;
use shoal::config::{Cli, Command, Output, ServeConfig};
use tracing_subscriber::EnvFilter;

/// mimalloc instead of the system allocator: fewer CPU cycles per request and less memory per
/// cached item than glibc's malloc (see `tests/perf/README.md`).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(config) => serve(config),
        Command::Bench(args) => {
            let output = args.output;
            shoal::bench::run(args).map(|report| match output {
                Output::Table => print!("{}", shoal::bench::table(&report)),
                Output::Json => println!("{}", serde_json::to_string_pretty(&report).unwrap_or_default()),
            })
        }
        command => client_runtime().and_then(|rt| rt.block_on(shoal::cli::run(command))),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::FAILURE
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
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,openraft=warn"));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
    config.validate().map_err(|e| format!("invalid configuration: {e}"))?;
    server_runtime(config.worker_threads)?.block_on(async {
        let node = shoal::node::start(config).await.map_err(|e| {
            tracing::error!("{e}");
            e.to_string()
        })?;
        tokio::select! {
            _ = shutdown_signal() => tracing::info!("shutting down"),
            _ = node.stopped() => {}
        }
        node.shutdown().await;
        Ok(())
    })
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
