//! A small HTTP/1.1 client for the operations listener, used by
//! `nackd admin` and by the tests: one request per connection
//! (`Connection: close`), the body read to the end.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How long a whole request may take.
const TIMEOUT: Duration = Duration::from_secs(30);

/// A response.
#[derive(Clone, Debug)]
pub struct HttpResponse {
    /// Status code.
    pub status: u16,
    /// `Content-Type`, if any.
    pub content_type: Option<String>,
    /// Body, as text.
    pub body: String,
}

/// Why a request failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Connect, write or read failed.
    #[error("{address}: {source}")]
    Io {
        /// `host:port`.
        address: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// No answer in time.
    #[error("{0}: no answer in 30 s")]
    Timeout(String),
    /// The answer is not HTTP.
    #[error("{address}: malformed HTTP response: {reason}")]
    Malformed {
        /// `host:port`.
        address: String,
        /// What is wrong.
        reason: &'static str,
    },
}

/// Sends `method target` (target = path and query) to `address`, with a
/// bearer token if given.
pub async fn request(
    address: &str,
    method: &str,
    target: &str,
    token: Option<&str>,
) -> Result<HttpResponse, ClientError> {
    let io = |source| ClientError::Io {
        address: address.to_string(),
        source,
    };
    let exchange = async {
        let mut stream = TcpStream::connect(address).await.map_err(io)?;
        let mut head = format!("{method} {target} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\nContent-Length: 0\r\n");
        if let Some(token) = token {
            head.push_str(&format!("Authorization: Bearer {token}\r\n"));
        }
        head.push_str("\r\n");
        stream.write_all(head.as_bytes()).await.map_err(io)?;
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await.map_err(io)?;
        parse(&raw).map_err(|reason| ClientError::Malformed {
            address: address.to_string(),
            reason,
        })
    };
    tokio::time::timeout(TIMEOUT, exchange)
        .await
        .map_err(|_| ClientError::Timeout(address.to_string()))?
}

fn parse(raw: &[u8]) -> Result<HttpResponse, &'static str> {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or("no end of headers")?;
    let head = std::str::from_utf8(&raw[..split]).map_err(|_| "headers are not UTF-8")?;
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|code| code.parse().ok())
        .ok_or("no status code")?;
    let mut content_type = None;
    let mut chunked = false;
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        match name.trim().to_ascii_lowercase().as_str() {
            "content-type" => content_type = Some(value.trim().to_string()),
            "transfer-encoding" => chunked = value.to_ascii_lowercase().contains("chunked"),
            _ => {}
        }
    }
    let body = &raw[split + 4..];
    let body = if chunked {
        dechunk(body)?
    } else {
        body.to_vec()
    };
    Ok(HttpResponse {
        status,
        content_type,
        body: String::from_utf8_lossy(&body).into_owned(),
    })
}

fn dechunk(mut rest: &[u8]) -> Result<Vec<u8>, &'static str> {
    let mut out = Vec::new();
    loop {
        let line_end = rest
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or("chunk size line")?;
        let size_text = std::str::from_utf8(&rest[..line_end]).map_err(|_| "chunk size")?;
        let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
            .map_err(|_| "chunk size")?;
        rest = &rest[line_end + 2..];
        if size == 0 {
            return Ok(out);
        }
        if rest.len() < size + 2 {
            return Err("short chunk");
        }
        out.extend_from_slice(&rest[..size]);
        rest = &rest[size + 2..];
    }
}

/// `?k=v&...` with every value percent-encoded (vhost `/` included).
pub fn query(pairs: &[(&str, &str)]) -> String {
    let encode = |s: &str| {
        s.bytes()
            .map(|b| match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                    (b as char).to_string()
                }
                _ => format!("%{b:02X}"),
            })
            .collect::<String>()
    };
    let joined: Vec<String> = pairs
        .iter()
        .map(|(k, v)| format!("{k}={}", encode(v)))
        .collect();
    if joined.is_empty() {
        String::new()
    } else {
        format!("?{}", joined.join("&"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_plain_and_chunked_bodies() {
        let plain = parse(b"HTTP/1.1 401 Unauthorized\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}").unwrap();
        assert_eq!(
            (
                plain.status,
                plain.content_type.as_deref(),
                plain.body.as_str()
            ),
            (401, Some("application/json"), "{}")
        );
        let chunked = parse(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n").unwrap();
        assert_eq!(chunked.body, "abcde");
        assert!(parse(b"garbage").is_err());
    }

    #[test]
    fn query_values_are_percent_encoded() {
        assert_eq!(
            query(&[("queue", "a b/c"), ("vhost", "/")]),
            "?queue=a%20b%2Fc&vhost=%2F"
        );
        assert_eq!(query(&[]), "");
    }
}
