//! What an AWS answer means for each event it answered: error codes classified (retry, throttled,
//! rejected), a whole call's failure, and the per-entry results of a batch call.

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use aws_smithy_runtime_api::client::orchestrator::HttpResponse;
use aws_smithy_runtime_api::client::result::SdkError;
use aws_smithy_types::error::metadata::ProvideErrorMetadata;

use crate::model::outcome::Outcome;
use crate::model::retry::parse_retry_after;

/// Error codes of a throttled request (any AWS service): retried, honouring `Retry-After`.
const THROTTLING: &[&str] = &[
    "Throttling",
    "ThrottlingException",
    "ThrottledException",
    "RequestThrottled",
    "RequestThrottledException",
    "TooManyRequestsException",
    "ProvisionedThroughputExceededException",
    "RequestLimitExceeded",
    "LimitExceededException",
    "SlowDown",
    "KMSThrottlingException",
    "KMS.ThrottlingException",
];

/// Error codes that say the event itself can never be accepted, however often it is sent.
const PERMANENT: &[&str] = &[
    "InvalidMessageContents",
    "InvalidParameterValue",
    "InvalidParameterValueException",
    "InvalidParameter",
    "InvalidArgument",
    "InvalidAttributeName",
    "InvalidAttributeValue",
    "MessageTooLong",
    "MalformedDetail",
    "ValidationException",
    "ValidationError",
    "EntityTooLarge",
];

/// What an AWS error means for the event it answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Try again per the retry policy.
    Retry,
    /// The service asked us to slow down: try again, after its `Retry-After` when it gave one.
    Throttled,
    /// The event can never be accepted: dead-letter it.
    Rejected,
}

/// The verdict on an error `code` (`None`: the request got no answer, or one without a code).
pub(crate) fn verdict(code: Option<&str>) -> Verdict {
    match code {
        Some(c) if THROTTLING.contains(&c) => Verdict::Throttled,
        Some(c) if PERMANENT.contains(&c) => Verdict::Rejected,
        _ => Verdict::Retry,
    }
}

/// The outcome of an error with `code` and `message` from `service` (`"SQS"`), waiting
/// `retry_after` when throttled.
pub(crate) fn outcome(
    service: &str,
    code: Option<&str>,
    message: &str,
    retry_after: Option<Duration>,
) -> Outcome {
    let said = match code {
        Some(code) => format!("{service} answered {code}: {message}"),
        None => format!("{service}: {message}"),
    };
    match verdict(code) {
        Verdict::Retry => Outcome::retry(said),
        Verdict::Throttled => Outcome::Retry {
            reason: said,
            retry_after,
        },
        Verdict::Rejected => Outcome::Rejected { reason: said },
    }
}

/// The outcome of a whole call that failed, for each event it carried.
pub(crate) fn call_failed<E>(service: &str, err: &SdkError<E, HttpResponse>) -> Outcome
where
    E: ProvideErrorMetadata + std::error::Error + 'static,
{
    let retry_after = err
        .raw_response()
        .and_then(|r| r.headers().get("retry-after"))
        .and_then(|v| parse_retry_after(v, SystemTime::now()));
    match err {
        SdkError::ServiceError(service_err) => {
            let e = service_err.err();
            let status = service_err.raw().status().as_u16();
            let message = e
                .message()
                .map(str::to_owned)
                .unwrap_or_else(|| format!("HTTP {status}"));
            outcome(service, e.code(), &message, retry_after)
        }
        // No answer (connection, timeout, credentials not found, an answer that does not parse):
        // the cause chain says which.
        other => Outcome::retry(format!("{service}: {}", chain(other))),
    }
}

/// An error and its causes, joined by `: `.
fn chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let more = cause.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        source = cause.source();
    }
    text
}

/// The outcomes of one batch call that was answered, one per entry of `ids` (in order): `failed`
/// entries (id, error code, message) get theirs, `succeeded` ones are delivered, and an entry the
/// answer does not mention is retried.
pub(crate) fn entry_outcomes<'a>(
    service: &str,
    ids: &[String],
    succeeded: impl IntoIterator<Item = &'a str>,
    failed: impl IntoIterator<Item = (&'a str, Option<&'a str>, &'a str)>,
) -> Vec<Outcome> {
    let at: HashMap<&str, usize> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| (id.as_str(), i))
        .collect();
    let mut out = vec![
        Outcome::retry(format!(
            "{service} did not answer for this entry of the batch"
        ));
        ids.len()
    ];
    for id in succeeded {
        if let Some(&i) = at.get(id) {
            out[i] = Outcome::Delivered;
        }
    }
    for (id, code, message) in failed {
        if let Some(&i) = at.get(id) {
            out[i] = outcome(service, code, message, None);
        }
    }
    out
}

/// The outcomes of a batch call of `$len` entries to `$service` whose answer lists one result per
/// entry, in the entries' order (Kinesis, EventBridge): `$results`, each with its `error_code` and
/// `error_message` (the SDKs name them alike). A call that failed fails every entry.
macro_rules! in_order {
    ($service:expr, $len:expr, $answer:expr, $results:ident) => {
        match $answer {
            Ok(out) => $crate::sinks::aws::positional(
                $service,
                $len,
                out.$results()
                    .iter()
                    .map(|r| (r.error_code(), r.error_message())),
            ),
            Err(e) => vec![$crate::sinks::aws::call_failed($service, &e); $len],
        }
    };
}
pub(crate) use in_order;

/// The outcomes of a batch call whose answer lists one result per entry, in the entries' order
/// (Kinesis, EventBridge): `(error code, message)`, the code `None` for an entry accepted.
pub(crate) fn positional<'a>(
    service: &str,
    len: usize,
    results: impl IntoIterator<Item = (Option<&'a str>, Option<&'a str>)>,
) -> Vec<Outcome> {
    let ids: Vec<String> = (0..len).map(|i| i.to_string()).collect();
    let results: Vec<_> = results.into_iter().take(len).collect();
    let succeeded = results
        .iter()
        .enumerate()
        .filter(|(_, (code, _))| code.is_none())
        .map(|(i, _)| ids[i].as_str());
    let failed = results
        .iter()
        .enumerate()
        .filter_map(|(i, (code, message))| {
            code.map(|c| (ids[i].as_str(), Some(c), message.unwrap_or("no message")))
        });
    entry_outcomes(service, &ids, succeeded, failed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_classified() {
        for (code, expected) in [
            (Some("ThrottlingException"), Verdict::Throttled),
            (
                Some("ProvisionedThroughputExceededException"),
                Verdict::Throttled,
            ),
            (Some("SlowDown"), Verdict::Throttled),
            (Some("RequestThrottled"), Verdict::Throttled),
            (Some("InvalidMessageContents"), Verdict::Rejected),
            (Some("MalformedDetail"), Verdict::Rejected),
            (Some("InvalidParameterValue"), Verdict::Rejected),
            // Queues are created and policies fixed while events wait.
            (
                Some("AWS.SimpleQueueService.NonExistentQueue"),
                Verdict::Retry,
            ),
            (Some("QueueDoesNotExist"), Verdict::Retry),
            (Some("AccessDenied"), Verdict::Retry),
            (Some("ExpiredToken"), Verdict::Retry),
            (Some("InternalFailure"), Verdict::Retry),
            (Some("SomethingNew"), Verdict::Retry),
            (None, Verdict::Retry),
        ] {
            assert_eq!(verdict(code), expected, "{code:?}");
        }
    }
    #[test]
    fn throttling_waits_as_asked_and_rejection_keeps_the_message() {
        let wait = Some(Duration::from_secs(3));
        assert_eq!(
            outcome("SQS", Some("ThrottlingException"), "slow down", wait),
            Outcome::Retry {
                reason: "SQS answered ThrottlingException: slow down".into(),
                retry_after: wait
            }
        );
        assert_eq!(
            outcome("SQS", Some("AccessDenied"), "no", wait),
            Outcome::retry("SQS answered AccessDenied: no"),
            "only throttling sets the wait"
        );
        assert_eq!(
            outcome("Kinesis", Some("ValidationException"), "too big", None),
            Outcome::Rejected {
                reason: "Kinesis answered ValidationException: too big".into()
            }
        );
    }
    #[test]
    fn entries_get_their_own_outcome_and_unanswered_ones_are_retried() {
        let ids = ["7", "8", "9", "10"].map(String::from);
        let got = entry_outcomes(
            "SQS",
            &ids,
            ["7", "10", "99"],
            [("8", Some("InvalidMessageContents"), "bad")],
        );
        assert_eq!(got[0], Outcome::Delivered);
        assert!(matches!(got[1], Outcome::Rejected { .. }));
        assert!(
            matches!(&got[2], Outcome::Retry { reason, .. } if reason.contains("did not answer"))
        );
        assert_eq!(got[3], Outcome::Delivered);
    }
    #[test]
    fn positional_answers_match_entries_in_order() {
        let got = positional(
            "Kinesis",
            3,
            [
                (None, None),
                (Some("ProvisionedThroughputExceededException"), Some("slow")),
            ],
        );
        assert_eq!(got[0], Outcome::Delivered);
        assert!(
            matches!(&got[1], Outcome::Retry { reason, .. } if reason.contains("ProvisionedThroughput"))
        );
        assert!(
            matches!(&got[2], Outcome::Retry { reason, .. } if reason.contains("did not answer"))
        );
    }
}
