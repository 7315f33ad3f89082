//! The `pgoutbox` command: migrate the schema, run the relay, inspect and repair the outbox.

mod bench;
mod cli;
mod connect;
mod flags;

use std::process::ExitCode;

fn main() -> ExitCode {
    // Before any connection: a database URL with sslmode=verify-ca or verify-full builds a
    // certificate verifier at once, and would panic without a provider chosen.
    pgoutbox::install_crypto_provider();
    let cli = <cli::Cli as clap::Parser>::parse();
    cli::init_logging(&cli);
    // The bench's producer process runs on one thread, as a pgbench thread does: its work is
    // a few thousand small commits a second, and a multi-thread runtime's idle workers spend
    // CPU looking for work at every wake-up, CPU the measured relay then lacks.
    let mut builder = if cli.is_bench_producer() {
        tokio::runtime::Builder::new_current_thread()
    } else {
        tokio::runtime::Builder::new_multi_thread()
    };
    let runtime = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(cli::run(cli)) {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {err}");
            for cause in err.chain().skip(1) {
                eprintln!("  caused by: {cause}");
            }
            ExitCode::FAILURE
        }
    }
}
