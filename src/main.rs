//! The `pgoutbox` command: migrate the schema, run the relay, inspect and repair the outbox.

mod cli;
mod connect;

use std::process::ExitCode;

/// The process's allocator. The relay allocates and frees small buffers for every event it
/// decodes and sends; glibc's malloc spent a quarter of a webhook relay's CPU on them, CPU the
/// application's own commits lack when they share the machine (docs/performance.md, "The
/// allocator").
#[cfg(not(target_env = "msvc"))]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// The allocator's settings, which jemalloc reads when it starts (its `malloc_conf`, under the
/// prefix the crate builds it with). A background thread gives pages freed a second ago back to
/// the system: otherwise jemalloc keeps them until allocations touch their arena again, and a
/// relay that read ten thousand destinations at start kept the memory of that read for as long as
/// it idled (83 MiB against 57 MiB, docs/performance.md). `MALLOC_CONF`-style settings in
/// `_RJEM_MALLOC_CONF` still win.
#[cfg(not(target_env = "msvc"))]
#[allow(non_upper_case_globals)]
#[export_name = "_rjem_malloc_conf"]
pub static malloc_conf: Option<&'static std::ffi::c_char> = Some(
    // SAFETY: a C string literal lives for the whole program and ends with its NUL.
    unsafe { &*c"background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0".as_ptr() },
);

/// The exit status of a panic that reached `main` (a bug): sysexits' `EX_SOFTWARE`, distinct from
/// an error's `1` and from Rust's default `101`.
const PANICKED: u8 = 70;

fn main() -> ExitCode {
    // Before any connection: a database URL with sslmode=verify-ca or verify-full builds a
    // certificate verifier at once, and would panic without a provider chosen.
    pgoutbox::install_crypto_provider();
    std::panic::set_hook(Box::new(|info| eprintln!("{}", panic_line(info))));
    guarded(run)
}

/// Runs `body`; a panic out of it becomes the exit status [`PANICKED`] (the hook has printed it).
fn guarded(body: impl FnOnce() -> ExitCode + std::panic::UnwindSafe) -> ExitCode {
    std::panic::catch_unwind(body).unwrap_or(ExitCode::from(PANICKED))
}

/// One line for a panic, wherever it happens (a sink's panic is caught and retried, a worker's
/// stops the relay; both print this first): where, what, and that it is a bug to report.
fn panic_line(info: &std::panic::PanicHookInfo<'_>) -> String {
    let message = info
        .payload()
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| info.payload().downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into());
    let place = info
        .location()
        .map(|l| format!(" at {}:{}", l.file(), l.line()))
        .unwrap_or_default();
    let thread = std::thread::current();
    format!(
        "error: internal error (a bug in pgoutbox {}, please report it with this line) in thread {}{place}: {message}",
        env!("CARGO_PKG_VERSION"),
        thread.name().unwrap_or("unnamed"),
    )
}

fn run() -> ExitCode {
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
            for cause in causes(&err) {
                eprintln!("  caused by: {cause}");
            }
            ExitCode::FAILURE
        }
    }
}

/// The lines under an error's sentence, one per cause. A cause whose text the line above
/// already ends with is left out: sqlx says "error returned from database: X" and then has X as
/// its source, which would print X twice.
fn causes(err: &anyhow::Error) -> Vec<String> {
    let mut lines = Vec::new();
    let mut above = err.to_string();
    for cause in err.chain().skip(1) {
        let text = cause.to_string();
        if !above.ends_with(&text) {
            lines.push(text.clone());
        }
        above = text;
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error that repeats its source in its own message, as sqlx's database errors do.
    #[derive(Debug, thiserror::Error)]
    #[error("error returned from database: {0}")]
    struct Repeats(#[source] Root);

    #[derive(Debug, thiserror::Error)]
    #[error("role \"nobody\" does not exist")]
    struct Root;

    #[test]
    fn a_cause_repeated_in_the_line_above_is_printed_once() {
        let err = anyhow::Error::new(Repeats(Root)).context("cannot connect to the database");
        assert_eq!(
            causes(&err),
            ["error returned from database: role \"nobody\" does not exist"]
        );
        let plain = anyhow::Error::new(Root).context("outer");
        assert_eq!(causes(&plain), ["role \"nobody\" does not exist"]);
    }

    #[test]
    fn a_panic_becomes_the_documented_exit_status() {
        assert_eq!(guarded(|| panic!("a bug")), ExitCode::from(PANICKED));
        assert_eq!(guarded(|| ExitCode::from(3)), ExitCode::from(3));
    }
}
