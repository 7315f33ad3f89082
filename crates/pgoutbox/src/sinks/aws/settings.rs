//! The keys every AWS sink takes beside its own — region, endpoint, timeout, TLS, body — read
//! with them from the destination's table ([`crate::config::Flat`]), and what a sink makes of
//! them: the shape of its messages and its SDK client.

use std::time::Duration;

use aws_config::SdkConfig;
use serde::Deserialize;

use super::{shape, Account, Connection};
use crate::config::duration_str;
use crate::sinks::body::{Body, Shape};
use crate::sinks::tls::TlsConfig;

/// The keys every AWS sink takes beside its own.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AwsSettings {
    /// The AWS region; default the provider chain's (`AWS_REGION`, the profile).
    pub region: Option<String>,
    /// Another endpoint than AWS's: a local emulator (or MinIO, for `s3`), a VPC endpoint.
    pub endpoint_url: Option<String>,
    /// How long to wait for a connection and for each call's answer (each object's write, for
    /// `s3`).
    #[serde(default = "crate::sinks::default_timeout", with = "duration_str")]
    pub timeout: Duration,
    /// `ca_file`: the certificate authorities to trust instead of the system's.
    #[serde(default)]
    pub tls: TlsConfig,
    /// What a message holds: `payload`, `envelope` or `cloudevents`. The default is the sink's:
    /// `payload` where attributes carry the event's id (`sqs`, `sns`), `envelope` elsewhere.
    pub body: Option<Body>,
    /// The CloudEvents `source` attribute (with a `cloudevents` body); default `pgoutbox`.
    pub cloudevents_source: Option<String>,
}

impl AwsSettings {
    /// Checks the settings of a sink of `service` whose `body` is `default` when not set (the
    /// error names the key): the shape of its messages, and its client, which `make` builds from
    /// the SDK configuration on first use.
    pub(crate) fn build<C>(
        self,
        service: &'static str,
        default: Body,
        make: impl Fn(&SdkConfig) -> C + Send + Sync + 'static,
    ) -> Result<(Shape, Connection<C>), String> {
        let shape = shape(
            self.body.unwrap_or(default),
            self.cloudevents_source,
            service,
        )?;
        let account = Account::new(self.region, self.endpoint_url, self.timeout, &self.tls)?;
        Ok((shape, Connection::new(service, account, make)))
    }
}
