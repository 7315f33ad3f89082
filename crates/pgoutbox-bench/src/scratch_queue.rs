//! The scratch SQS queue of `bench drain --sinks sqs`: made before the run on `--sqs-endpoint`
//! (moto, LocalStack, or AWS itself), deleted after it. Credentials come from the SDK's chain, as
//! for the relay (`AWS_ACCESS_KEY_ID=x AWS_SECRET_ACCESS_KEY=x` suits an emulator). The queue is
//! purged every second while the drain runs: moto's `SendMessageBatch` takes longer the more the
//! queue holds (0.17 ms a message queued), and a drain that nobody consumes would measure that.

/// The region of the scratch queue when the environment names none.
#[cfg(feature = "sqs")]
const DEFAULT_REGION: &str = "us-east-1";

/// A scratch queue: its URL, and how to reach it.
pub struct ScratchQueue {
    /// The queue's URL.
    pub url: String,
    /// The endpoint it was made on.
    pub endpoint: String,
    /// The region it was made in.
    pub region: String,
    #[cfg(feature = "sqs")]
    client: aws_sdk_sqs::Client,
    #[cfg(feature = "sqs")]
    purger: tokio::task::JoinHandle<()>,
}

impl ScratchQueue {
    /// Makes a standard queue named after this process on `endpoint`.
    #[cfg(feature = "sqs")]
    pub async fn create(endpoint: &str) -> anyhow::Result<Self> {
        use anyhow::Context;
        let region = std::env::var("AWS_REGION").unwrap_or_else(|_| DEFAULT_REGION.to_owned());
        let account = pgoutbox::sinks::aws::Account::new(
            Some(region.clone()),
            Some(endpoint.to_owned()),
            std::time::Duration::from_secs(10),
            &Default::default(),
        )
        .map_err(anyhow::Error::msg)?;
        let client = aws_sdk_sqs::Client::new(account.sdk().await);
        let name = format!("pgoutbox-bench-{}", std::process::id());
        let made = client
            .create_queue()
            .queue_name(&name)
            .send()
            .await
            .map_err(|e| anyhow::anyhow!(aws_sdk_sqs::error::DisplayErrorContext(e)))
            .with_context(|| {
                format!("cannot make the scratch queue {name} on {endpoint} (an emulator must be running there, and the SDK needs credentials: AWS_ACCESS_KEY_ID=x AWS_SECRET_ACCESS_KEY=x suit one)")
            })?;
        let url = made
            .queue_url()
            .context("the emulator answered without a queue URL")?
            .to_owned();
        let purger = tokio::spawn({
            let (client, url) = (client.clone(), url.clone());
            async move {
                loop {
                    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                    // AWS allows one purge a minute: the others fail, and the queue grows.
                    let _ = client.purge_queue().queue_url(&url).send().await;
                }
            }
        });
        Ok(Self {
            url,
            endpoint: endpoint.to_owned(),
            region,
            client,
            purger,
        })
    }

    /// Without the `sqs` feature there is no SQS sink to bench.
    #[cfg(not(feature = "sqs"))]
    pub async fn create(_endpoint: &str) -> anyhow::Result<Self> {
        anyhow::bail!("this build has no sqs sink: build with --features sqs")
    }

    /// The destination's settings (TOML lines).
    pub fn settings(&self) -> String {
        format!(
            "type = \"sqs\"\nqueue_url = \"{}\"\nendpoint_url = \"{}\"\nregion = \"{}\"\n",
            self.url, self.endpoint, self.region
        )
    }

    /// Deletes the queue (its messages with it); a failure is only reported.
    pub async fn delete(self) {
        #[cfg(feature = "sqs")]
        {
            self.purger.abort();
            if let Err(e) = self.client.delete_queue().queue_url(&self.url).send().await {
                eprintln!("could not delete the scratch queue {}: {e}", self.url);
            }
        }
    }
}
