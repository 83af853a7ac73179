//! Log lines on stderr in the form kvlens prints them: vLLM's level name, a space, the message
//! (`INFO Starting vLLM API server on …`, `WARNING …`, `ERROR …`), the form tests and
//! `kvlens plan --from-log` read back.

use std::fmt;
use tracing::level_filters::LevelFilter;
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::EnvFilter;

/// Sends `tracing` events to stderr at INFO and above, or as `RUST_LOG` filters them.
pub fn init() {
    let filter = EnvFilter::builder()
        .with_default_directive(LevelFilter::INFO.into())
        .from_env_lossy();
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .event_format(VllmLevel)
        .init();
}

/// `LEVEL message`, with the level spelled as Python's `logging` (and so vLLM) spells it.
#[derive(Debug)]
struct VllmLevel;

impl<S, N> FormatEvent<S, N> for VllmLevel
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(&self, ctx: &FmtContext<'_, S, N>, mut writer: Writer<'_>, event: &Event<'_>) -> fmt::Result {
        let level = match *event.metadata().level() {
            Level::ERROR => "ERROR",
            Level::WARN => "WARNING",
            Level::INFO => "INFO",
            Level::DEBUG => "DEBUG",
            Level::TRACE => "TRACE",
        };
        write!(writer, "{level} ")?;
        ctx.field_format().format_fields(writer.by_ref(), event)?;
        writeln!(writer)
    }
}
