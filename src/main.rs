//! The `shoal` binary: parse the command line, then run a node or a client command.

use std::process::ExitCode;

use clap::Parser;
use shoal::config::{Cli, Command};
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let Command::Serve(config) = cli.command else {
        return match shoal::cli::run(cli.command).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(message) => {
                eprintln!("error: {message}");
                ExitCode::FAILURE
            }
        };
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,openraft=warn"));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
    let node = match shoal::node::start(config).await {
        Ok(node) => node,
        Err(e) => {
            tracing::error!("{e}");
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    tokio::select! {
        _ = shutdown_signal() => tracing::info!("shutting down"),
        _ = node.stopped() => {}
    }
    node.shutdown().await;
    ExitCode::SUCCESS
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
