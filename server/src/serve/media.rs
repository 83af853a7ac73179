//! Remote images. An `http://` image URL whose host is in `--allowed-media-domains` is fetched (at most
//! [`MAX_MEDIA_BYTES`], within [`FETCH_TIMEOUT`]) and handed to preprocessing as a data URL; every other
//! remote URL is refused with the reason. `https://` is refused too: this build has no TLS stack.

use super::errors::ApiError;
use base64::Engine as _;
use http_body_util::{BodyExt, Empty, Limited};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use kvlens_engine::input::chat::ChatMessage;
use std::time::Duration;

/// Largest image body fetched.
pub const MAX_MEDIA_BYTES: usize = 64 << 20;

/// Longest a fetch may take.
pub const FETCH_TIMEOUT: Duration = Duration::from_secs(10);

/// The host of an `http(s)://[user@]host[:port]/…` URL, lower-cased.
fn host_of(url: &str) -> String {
    let rest = url.split_once("://").map_or("", |(_, rest)| rest);
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    let host = authority.rsplit('@').next().unwrap_or(authority);
    host.split(':').next().unwrap_or(host).to_ascii_lowercase()
}

/// Whether `url` may be fetched; the refusal says why.
fn check(url: &str, allowed: &[String]) -> Result<(), ApiError> {
    let host = host_of(url);
    if allowed.is_empty() {
        return Err(ApiError::bad_request(format!(
            "fetching remote images is off ({url}): send the image as a base64 data URL, or start the server with --allowed-media-domains {host}"
        )));
    }
    if !allowed.iter().any(|d| d.eq_ignore_ascii_case(&host)) {
        return Err(ApiError::bad_request(format!(
            "the domain of {url} is not in --allowed-media-domains"
        )));
    }
    if url.get(..8).is_some_and(|s| s.eq_ignore_ascii_case("https://")) {
        return Err(ApiError::bad_request(format!(
            "this build does not fetch https URLs (no TLS): {url}; send a data URL or an http URL"
        )));
    }
    Ok(())
}

/// GETs one allowed URL: the body of a 200 answer.
async fn fetch(url: &str) -> Result<Bytes, ApiError> {
    let failed = |why: String| ApiError::bad_request(format!("cannot fetch the image {url}: {why}"));
    let uri: hyper::Uri = url.parse().map_err(|e| failed(format!("{e}")))?;
    let client: Client<_, Empty<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let get = async {
        let resp = client.get(uri).await.map_err(|e| failed(e.to_string()))?;
        if resp.status() != hyper::StatusCode::OK {
            return Err(failed(format!("the server answered {}", resp.status())));
        }
        Limited::new(resp.into_body(), MAX_MEDIA_BYTES)
            .collect()
            .await
            .map(|b| b.to_bytes())
            .map_err(|e| failed(format!("{e} (at most {MAX_MEDIA_BYTES} bytes)")))
    };
    tokio::time::timeout(FETCH_TIMEOUT, get)
        .await
        .map_err(|_| failed(format!("no answer within {} s", FETCH_TIMEOUT.as_secs())))?
}

/// Replaces every allowed `http://` image URL in `messages` by a data URL of its bytes; refuses the
/// other remote URLs. Data URLs and paths are left for preprocessing to judge.
pub async fn resolve_remote_images(messages: &mut [ChatMessage], allowed: &[String]) -> Result<(), ApiError> {
    for url in messages.iter_mut().flat_map(ChatMessage::image_urls_mut) {
        let trimmed = url.trim();
        let remote = ["http://", "https://"]
            .iter()
            .any(|p| trimmed.get(..p.len()).is_some_and(|s| s.eq_ignore_ascii_case(p)));
        if !remote {
            continue;
        }
        check(trimmed, allowed)?;
        let bytes = fetch(trimmed).await?;
        *url = format!(
            "data:application/octet-stream;base64,{}",
            base64::engine::general_purpose::STANDARD.encode(&bytes)
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_urls_need_an_allowed_http_host() {
        let allowed = vec!["example.com".to_string()];
        assert_eq!(host_of("http://user@Example.COM:8080/a.png?x"), "example.com");
        let e = check("http://example.com/a.png", &[]).unwrap_err();
        assert!(e.message.contains("--allowed-media-domains example.com"), "{e}");
        let e = check("https://user@evil.org:8443/a.png", &allowed).unwrap_err();
        assert!(e.message.contains("not in --allowed-media-domains"), "{e}");
        let e = check("https://example.com/a.png", &allowed).unwrap_err();
        assert!(e.message.contains("no TLS"), "{e}");
        assert!(check("http://example.com:81/a.png", &allowed).is_ok());
    }
}
