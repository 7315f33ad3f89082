//! What the `sqs` and `sns` sinks are: each event is a message with attributes ([`message`]),
//! ten to a batch call, sent to the queue or topic a template names for it. On a FIFO one (its
//! name ends in `.fifo`) `MessageGroupId` is the event's key — its id when it has none — and
//! `MessageDeduplicationId` its id, and its calls go one after another; other targets' calls go
//! side by side. Each entry gets its own answer.
//!
//! The two SDKs name alike all that this needs but the batch call, the entry's body and the
//! readiness check: [`message_sink!`] writes an SDK's [`MessageApi`] from those names, with the
//! sink's registry entry and settings.

use async_trait::async_trait;
use aws_config::SdkConfig;
use serde::de::DeserializeOwned;

use super::{
    fifo, group, message, publish_each, ready_as, reserved, AwsSettings, Batches, Calls,
    Connection, Limits, Message, Record,
};
use crate::config::Flat;
use crate::model::event::OutboxEvent;
use crate::model::outcome::Outcome;
use crate::model::template::Template;
use crate::sinks::body::{Body, Shape};
use crate::sinks::reserved::Reserved;

/// What one `SendMessageBatch` or `PublishBatch` takes — ten entries, 256 KiB of bodies and
/// attributes together — and a FIFO queue or topic keeps each message group's order.
const CALLS: Calls = Calls {
    limits: Limits {
        entries: 10,
        bytes: 256 * 1024,
    },
    ordered: fifo,
};

/// An SDK client that sends batches of messages with attributes (SQS, SNS).
#[async_trait]
pub trait MessageApi: Send + Sync + 'static {
    /// The service, in messages (`SQS`), and the sink's type (`sqs`).
    const NAMES: (&'static str, &'static str);
    /// What a destination names, in readiness messages: `queue`, `topic`.
    const TARGET: &'static str;
    /// One message of a batch call.
    type Entry: Clone + Send + Sync + 'static;
    /// The keys only its sink takes.
    type Settings: DeserializeOwned;

    /// The template of `settings` that names each event's queue or topic.
    fn target(settings: Self::Settings) -> Template;

    /// Whether `target` can name a queue or topic (no I/O); the error names the key.
    fn valid(target: &Template) -> Result<(), String>;

    /// The client of the SDK configuration `sdk`.
    fn client(sdk: &SdkConfig) -> Self;

    /// The batch entry of `message` named `id` within its call; `fifo`, on a FIFO target: its
    /// message group and deduplication id.
    fn entry(
        id: String,
        message: Message,
        fifo: Option<(String, String)>,
    ) -> Result<Self::Entry, String>;

    /// Sends `entries` to `target` in one call: one outcome per entry, in order.
    async fn send_batch(&self, target: &str, entries: Vec<Self::Entry>) -> Vec<Outcome>;

    /// Asks for `target` in one call; the error is the outcome the failure comes to.
    async fn check(&self, target: &str) -> Result<(), Outcome>;
}

/// Declares the sink of one service in its module: its registry entry and settings
/// ([`crate::sinks::sink_type!`]) for `type = $kind`; `$settings`, its one key `$field`, the
/// template naming each event's queue or topic; `$sink`, the [`Messages`] sink over the client of
/// the SDK crate `$sdk`; and that client's [`MessageApi`]: `$service` names the service in
/// messages and `$target` what a destination names, `$entry` is its batch entry, whose builder
/// takes the body with `$body`, `$call` its batch call, which takes the target with `$to` and the
/// entries with `$entries`, `$valid` checks a target's template when the settings load, and `check` its readiness check (a request ready to send). The module
/// names `AwsSettings`, as any AWS sink's does.
macro_rules! message_sink {
    (
        kind: $kind:literal,
        service: $service:literal,
        sdk: $sdk:ident,
        $(#[$sink_doc:meta])*
        sink: $sink:ident,
        config: $config:ident,
        $(#[$settings_doc:meta])*
        settings: $settings:ident { $(#[$field_doc:meta])* $field:ident },
        target: $target:literal,
        entry: $entry:ident.$body:ident,
        call: $call:ident.$to:ident.$entries:ident,
        valid: $valid:path,
        check: |$client:ident, $name:ident| $check:expr $(,)?
    ) => {
        $crate::sinks::sink_type!(
            /// `body` (what a message holds) is `payload` by default.
            $kind: $sink, $config = $settings + AwsSettings
        );

        $crate::sinks::own_settings! {
            $(#[$settings_doc])*
            pub struct $settings {
                $(#[$field_doc])*
                pub $field: $crate::model::template::Template,
            }
        }

        $(#[$sink_doc])*
        pub type $sink = $crate::sinks::aws::Messages<$sdk::Client>;

        #[async_trait::async_trait]
        impl $crate::sinks::aws::MessageApi for $sdk::Client {
            const NAMES: (&'static str, &'static str) = ($service, $kind);
            const TARGET: &'static str = $target;
            type Entry = $sdk::types::$entry;
            type Settings = $settings;

            fn target(settings: $settings) -> $crate::model::template::Template {
                settings.$field
            }

            fn valid(target: &$crate::model::template::Template) -> Result<(), String> {
                $valid(target)
            }

            fn client(sdk: &::aws_config::SdkConfig) -> Self {
                Self::new(sdk)
            }

            fn entry(
                id: String,
                message: $crate::sinks::aws::Message,
                fifo: Option<(String, String)>,
            ) -> Result<Self::Entry, String> {
                let service = Self::NAMES.0;
                let mut entry = $sdk::types::$entry::builder().id(id).$body(message.body);
                for (name, value) in message.attributes {
                    let value = $sdk::types::MessageAttributeValue::builder()
                        .data_type("String")
                        .string_value(value)
                        .build()
                        .map_err(|e| {
                            format!("cannot make the {service} message attribute {name}: {e}")
                        })?;
                    entry = entry.message_attributes(name, value);
                }
                if let Some((group, deduplication)) = fifo {
                    entry = entry
                        .message_group_id(group)
                        .message_deduplication_id(deduplication);
                }
                entry
                    .build()
                    .map_err(|e| format!("cannot make the {service} message: {e}"))
            }

            async fn send_batch(
                &self,
                target: &str,
                entries: Vec<Self::Entry>,
            ) -> Vec<$crate::model::outcome::Outcome> {
                let service = Self::NAMES.0;
                let ids: Vec<String> = entries.iter().map(|e| e.id().to_owned()).collect();
                let answer = self
                    .$call()
                    .$to(target)
                    .$entries(Some(entries))
                    .send()
                    .await;
                match answer {
                    // One SDK gives each delivered entry's id as a string, the other as an option.
                    Ok(out) => $crate::sinks::aws::entry_outcomes(
                        service,
                        &ids,
                        out.successful()
                            .iter()
                            .filter_map(|s| Option::<&str>::from(s.id())),
                        out.failed()
                            .iter()
                            .map(|f| (f.id(), Some(f.code()), f.message().unwrap_or("no message"))),
                    ),
                    Err(e) => vec![$crate::sinks::aws::call_failed(service, &e); ids.len()],
                }
            }

            async fn check(&self, $name: &str) -> Result<(), $crate::model::outcome::Outcome> {
                let $client = self;
                let answer = $check.send().await;
                answer
                    .map(drop)
                    .map_err(|e| $crate::sinks::aws::call_failed(Self::NAMES.0, &e))
            }
        }
    };
}
pub(crate) use message_sink;

/// An SQS or SNS sink: the queue or topic each event goes to, and how its message is made.
pub struct Messages<A> {
    target: Template,
    shape: Shape,
    reserved: Reserved,
    client: Connection<A>,
}

impl<A: MessageApi> std::fmt::Debug for Messages<A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Messages")
            .field("service", &A::NAMES.0)
            .field(A::TARGET, &self.target)
            .finish_non_exhaustive()
    }
}

impl<A: MessageApi> Messages<A> {
    /// Validates the settings of a sink sending to the queues or topics they name (`body` is
    /// `payload` by default); connects on the first publish.
    pub fn new(cfg: Flat<A::Settings, AwsSettings>) -> Result<Self, String> {
        let (service, sink) = A::NAMES;
        let (shape, client) = cfg.common.build(service, Body::Payload, A::client)?;
        let target = A::target(cfg.own);
        A::valid(&target)?;
        Ok(Self {
            target,
            shape,
            reserved: reserved(sink),
            client,
        })
    }

    /// The batch entry of `event`, named `id` within its call to `target`, and its size against
    /// the limits.
    fn entry(
        &self,
        id: usize,
        event: &OutboxEvent,
        target: &str,
    ) -> Result<(A::Entry, usize), String> {
        let message = message(&self.shape, event, &self.reserved);
        let size = message.size;
        let fifo = fifo(target).then(|| (group(event), event.id.to_string()));
        A::entry(id.to_string(), message, fifo).map(|entry| (entry, size))
    }
}

#[async_trait]
impl<A: MessageApi> Batches for Messages<A> {
    async fn send_all(&self, events: &[&OutboxEvent], record: Record<'_>) {
        let entry = |i, event: &OutboxEvent, target: &str| self.entry(i, event, target);
        let send = |target: String, built| async move {
            let client = self.client.get().await;
            client.send_batch(&target, built).await
        };
        publish_each(events, &self.target, CALLS, entry, send, record).await;
    }

    async fn ready(&self) -> Result<(), String> {
        ready_as(&self.target, A::TARGET, |target| async move {
            self.client.get().await.check(target).await
        })
        .await
    }
}
