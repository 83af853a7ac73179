//! Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`, with the status
//! codes vLLM answers (400 for anything the client got wrong).

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};

/// An HTTP error answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// The status code.
    pub status: StatusCode,
    /// What went wrong, for people.
    pub message: String,
}

impl ApiError {
    /// 400: the request cannot be served as sent.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    /// 401: `--api-key` is set and the request did not carry it.
    pub fn unauthorized() -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "Unauthorized")
    }

    /// 404: no such route.
    pub fn not_found(path: &str) -> Self {
        Self::new(StatusCode::NOT_FOUND, format!("{path} not found"))
    }

    /// 404: the request names a model that is not served (vLLM's message).
    pub fn unknown_model(model: &str) -> Self {
        Self::new(StatusCode::NOT_FOUND, format!("The model `{model}` does not exist."))
    }

    /// 405: the route exists for other methods.
    pub fn method_not_allowed(method: &axum::http::Method, path: &str) -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            format!("{method} is not allowed on {path}"),
        )
    }

    /// 408: the request body did not arrive in time.
    pub fn request_timeout(limit: std::time::Duration) -> Self {
        Self::new(
            StatusCode::REQUEST_TIMEOUT,
            format!("the request body did not arrive within {} s", limit.as_secs_f64()),
        )
    }

    /// 409: the engine refuses the operation in its current state.
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, message)
    }

    /// 413: the body is over the limit.
    pub fn too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the request body is larger than {} MiB", limit >> 20),
        )
    }

    /// 415: a body that is not JSON.
    pub fn unsupported_media_type(given: impl std::fmt::Display) -> Self {
        Self::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            format!("the request body must be sent as Content-Type: application/json, got {given}"),
        )
    }

    /// 403: the request comes from a host or page this server does not serve.
    pub fn forbidden(message: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, message)
    }

    /// 503: the model is still loading, or the engine has stopped.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, message)
    }

    /// 500: the engine failed.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, message)
    }

    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
        }
    }

    /// vLLM's error type names.
    fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::BAD_REQUEST => "BadRequestError",
            StatusCode::UNAUTHORIZED => "AuthenticationError",
            StatusCode::FORBIDDEN => "PermissionDeniedError",
            StatusCode::NOT_FOUND => "NotFoundError",
            StatusCode::METHOD_NOT_ALLOWED => "MethodNotAllowed",
            StatusCode::REQUEST_TIMEOUT => "RequestTimeoutError",
            StatusCode::CONFLICT => "ConflictError",
            StatusCode::PAYLOAD_TOO_LARGE => "RequestEntityTooLargeError",
            StatusCode::UNSUPPORTED_MEDIA_TYPE => "UnsupportedMediaTypeError",
            StatusCode::SERVICE_UNAVAILABLE => "ServiceUnavailableError",
            _ => "InternalServerError",
        }
    }

    /// The JSON body (also sent as an SSE event when a stream fails).
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind(),
                "param": null,
                "code": self.status.as_u16(),
            }
        })
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status.as_u16(), self.message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        json_response(self.status, &self.body())
    }
}

/// A JSON answer with a status code.
pub fn json_response(status: StatusCode, value: &impl serde::Serialize) -> Response {
    match serde_json::to_string(value) {
        Ok(body) => (status, [(header::CONTENT_TYPE, "application/json")], body).into_response(),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("cannot serialize the answer: {e}"),
        )
            .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_has_openai_shape() {
        let e = ApiError::bad_request("temperature must be a non-negative number");
        let b = e.body();
        assert_eq!(b["error"]["type"], "BadRequestError");
        assert_eq!(b["error"]["code"], 400);
        assert!(b["error"]["param"].is_null());
        assert_eq!(ApiError::too_large(64 << 20).status.as_u16(), 413);
        assert_eq!(ApiError::unauthorized().body()["error"]["code"], 401);
    }
}
