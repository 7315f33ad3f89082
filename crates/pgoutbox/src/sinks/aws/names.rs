//! What an AWS sink's names must look like, checked when its settings are loaded or stored, so
//! that a setting that can never work is refused naming its key instead of failing every attempt
//! later ("NonExistentQueue", an SDK interceptor's message). No I/O: whether the queue exists is
//! the readiness check's business.
//!
//! A name given as a template is checked with each placeholder filled with a plain word: its
//! literal parts must make a valid name (`https://sqs.{header.region}.amazonaws.com/1/q` passes;
//! `{topic}` alone cannot be a queue URL and is refused).

use crate::model::template::Template;

/// What a placeholder stands for while a template is checked.
const FILL: &str = "x";

/// A region: a DNS label, as the SDK's endpoint resolver requires (`eu-west-1`).
pub(crate) fn region(region: &str) -> Result<(), String> {
    let label = !region.is_empty()
        && region.len() <= 63
        && region
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-')
        && !region.starts_with('-')
        && !region.ends_with('-');
    if label {
        Ok(())
    } else {
        Err(format!(
            "key `region`: {region:?} is not a region name (letters, digits and `-`, as in \"eu-west-1\")"
        ))
    }
}

/// An SQS queue URL: an `http://` or `https://` URL with a host and the queue's path.
pub(crate) fn queue_url(url: &Template) -> Result<(), String> {
    let sample = url.sample(FILL);
    let shown = url.as_str();
    let parsed = url::Url::parse(&sample)
        .map_err(|e| format!("key `queue_url`: {shown:?} is not a URL ({e})"))?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(format!(
            "key `queue_url`: {shown:?} must be an http:// or https:// URL, as \
             \"https://sqs.eu-west-1.amazonaws.com/123456789012/orders\""
        ));
    }
    if parsed.host_str().is_none_or(str::is_empty) || parsed.path().trim_matches('/').is_empty() {
        return Err(format!(
            "key `queue_url`: {shown:?} names no queue (a host, then the account and the queue)"
        ));
    }
    Ok(())
}

/// An ARN of `service`: `arn:PARTITION:SERVICE:REGION:ACCOUNT:RESOURCE`, for the key `key`.
pub(crate) fn arn(key: &str, value: &Template, service: &str) -> Result<(), String> {
    let sample = value.sample(FILL);
    let parts: Vec<&str> = sample.splitn(6, ':').collect();
    match parts.as_slice() {
        ["arn", partition, svc, _region, _account, resource]
            if !partition.is_empty() && *svc == service && !resource.is_empty() =>
        {
            Ok(())
        }
        _ => Err(format!(
            "key `{key}`: {:?} is not an {service} ARN (arn:aws:{service}:REGION:ACCOUNT:NAME)",
            value.as_str()
        )),
    }
}

/// A name, or the ARN of `service`: a name is 1 to `max` of ASCII letters, digits and `extra`.
pub(crate) fn name_or_arn(
    key: &str,
    value: &Template,
    service: &str,
    max: usize,
    extra: &str,
) -> Result<(), String> {
    let sample = value.sample(FILL);
    if sample.starts_with("arn:") {
        return arn(key, value, service);
    }
    let fits = !sample.is_empty()
        && sample.len() <= max
        && sample
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || extra.contains(c));
    if fits {
        Ok(())
    } else {
        let shown: String = extra.chars().map(|c| format!(" `{c}`")).collect();
        Err(format!(
            "key `{key}`: {:?} is neither a name (up to {max} letters, digits and{shown}) nor an \
             {service} ARN",
            value.as_str()
        ))
    }
}

/// An S3 bucket's name: 3 to 63 lowercase letters, digits, `.` and `-`, starting and ending with
/// a letter or digit.
pub(crate) fn bucket(bucket: &str) -> Result<(), String> {
    let edge = |c: Option<char>| c.is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    let fits = (3..=63).contains(&bucket.len())
        && bucket
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '.' || c == '-')
        && edge(bucket.chars().next())
        && edge(bucket.chars().last());
    if fits {
        Ok(())
    } else {
        Err(format!(
            "key `bucket`: {bucket:?} is not a bucket name (3 to 63 lowercase letters, digits, `.` \
             and `-`, starting and ending with a letter or digit)"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: &str) -> Template {
        Template::parse(s).expect("template")
    }

    #[test]
    fn regions() {
        for good in ["eu-west-1", "us-east-1", "local", "us-gov-west-1"] {
            assert!(region(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            "eu west 1",
            "eu_west_1",
            "-eu",
            "eu-",
            "https://x",
            "eu.west",
        ] {
            let e = region(bad).expect_err(bad);
            assert!(e.starts_with("key `region`"), "{e}");
        }
    }

    #[test]
    fn queue_urls() {
        for good in [
            "https://sqs.eu-west-1.amazonaws.com/123456789012/orders.fifo",
            "http://127.0.0.1:4566/000000000000/q",
            "https://sqs.eu-west-1.amazonaws.com/123456789012/{topic}",
            "https://sqs.{header.region}.amazonaws.com/1/q",
        ] {
            assert!(queue_url(&t(good)).is_ok(), "{good}");
        }
        for bad in [
            "orders",
            "sqs.eu-west-1.amazonaws.com/1/q",
            "ftp://sqs.example.com/1/q",
            "file:///etc/passwd",
            "https://sqs.eu-west-1.amazonaws.com/",
            "{topic}",
        ] {
            let e = queue_url(&t(bad)).expect_err(bad);
            assert!(e.starts_with("key `queue_url`"), "{e}");
        }
    }

    #[test]
    fn arns_and_names() {
        let sns = |s: &str| arn("topic_arn", &t(s), "sns");
        assert!(sns("arn:aws:sns:eu-west-1:123456789012:orders.fifo").is_ok());
        assert!(sns("arn:aws:sns:eu-west-1:123456789012:{topic}").is_ok());
        for bad in [
            "orders",
            "arn:aws:sqs:eu-west-1:1:q",
            "arn:aws:sns:eu-west-1:1",
            "{topic}",
        ] {
            let e = sns(bad).expect_err(bad);
            assert!(e.starts_with("key `topic_arn`"), "{e}");
        }
        let stream = |s: &str| name_or_arn("stream", &t(s), "kinesis", 128, "_.-");
        assert!(stream("orders").is_ok());
        assert!(stream("orders-{topic}").is_ok());
        assert!(stream("arn:aws:kinesis:eu-west-1:1:stream/orders").is_ok());
        for bad in [
            "orders/x",
            "arn:aws:sqs:eu-west-1:1:q",
            &"s".repeat(129),
            "a b",
        ] {
            let e = stream(bad).expect_err(bad);
            assert!(e.starts_with("key `stream`"), "{e}");
        }
    }

    #[test]
    fn buckets() {
        for good in ["events", "my.events-2026", "abc"] {
            assert!(bucket(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            "ab",
            "Events",
            "-events",
            "events-",
            "ev_ents",
            &"b".repeat(64),
        ] {
            let e = bucket(bad).expect_err(bad);
            assert!(e.starts_with("key `bucket`"), "{e}");
        }
    }
}
