//! The OpenAPI 3.1 document of the HTTP API (`GET /v1/openapi.json`), generated from the very
//! types the handlers parse and answer with: each is declared through [`api_object!`], which
//! derives serde and an [`ApiSchema`] (its JSON Schema) from one field list, so the document
//! cannot drift from the wire.

use std::collections::BTreeMap;

use serde_json::{json, Map, Value};

/// The named schemas of a document (`#/components/schemas`).
#[derive(Default)]
pub struct Components(BTreeMap<String, Value>);

impl Components {
    /// The `$ref` of the named object `name`, building its schema the first time.
    pub fn named(&mut self, name: &str, build: impl FnOnce(&mut Components) -> Value) -> Value {
        if !self.0.contains_key(name) {
            self.0.insert(name.to_string(), Value::Null);
            let schema = build(self);
            self.0.insert(name.to_string(), schema);
        }
        json!({ "$ref": format!("#/components/schemas/{name}") })
    }

    pub fn into_map(self) -> Map<String, Value> {
        self.0.into_iter().collect()
    }
}

/// A type's JSON Schema.
pub trait ApiSchema {
    /// The schema where the type appears (a `$ref` for named objects).
    fn schema(c: &mut Components) -> Value;
    /// May a field of this type be left out (`Option`)?
    fn optional() -> bool {
        false
    }
}

macro_rules! primitive {
    ($($t:ty => $schema:tt),* $(,)?) => {
        $(impl ApiSchema for $t {
            fn schema(_: &mut Components) -> Value {
                json!($schema)
            }
        })*
    };
}

primitive! {
    String => {"type": "string"},
    bool => {"type": "boolean"},
    i64 => {"type": "integer", "format": "int64"},
    u64 => {"type": "integer", "format": "int64", "minimum": 0},
    u32 => {"type": "integer", "format": "int32", "minimum": 0},
    usize => {"type": "integer", "minimum": 0},
    f64 => {"type": "number"},
    Value => {},
    Map<String, Value> => {"type": "object"},
}

impl<T: ApiSchema> ApiSchema for Option<T> {
    fn schema(c: &mut Components) -> Value {
        let inner = T::schema(c);
        match inner.get("type").and_then(|t| t.as_str()) {
            Some(t) => {
                let mut s = inner.clone();
                s["type"] = json!([t, "null"]);
                s
            }
            None if inner.as_object().is_some_and(|o| o.is_empty()) => inner,
            None => json!({"anyOf": [inner, {"type": "null"}]}),
        }
    }
    fn optional() -> bool {
        true
    }
}

impl<T: ApiSchema> ApiSchema for Vec<T> {
    fn schema(c: &mut Components) -> Value {
        json!({"type": "array", "items": T::schema(c)})
    }
}

/// The description of doc comments joined (each line trimmed).
pub fn doc_text(lines: &[&str]) -> String {
    lines
        .iter()
        .map(|l| l.trim())
        .collect::<Vec<_>>()
        .join(" ")
        .trim()
        .to_string()
}

/// Declare a wire type: the struct (with serde derives) and its [`ApiSchema`] from one list.
/// `request struct` refuses unknown fields (and says so in the schema); `response struct` and
/// `open struct` do not. Doc comments become descriptions; `Option` fields are not required.
macro_rules! api_object {
    (@kind request) => { false };
    (@kind response) => { true };
    (@kind open) => { true };
    (
        $(#[doc = $doc:literal])*
        $kind:ident struct $name:ident {
            $(
                $(#[doc = $fdoc:literal])*
                $(#[serde($($fattr:tt)*)])*
                $field:ident : $ty:ty
            ),* $(,)?
        }
    ) => {
        $crate::api::openapi::api_object!(@struct $kind, [$(#[doc = $doc])*], $name,
            [$( [$(#[doc = $fdoc])*] [$(#[serde($($fattr)*)])*] $field : $ty ),*]);

        impl $crate::api::openapi::ApiSchema for $name {
            fn schema(c: &mut $crate::api::openapi::Components) -> serde_json::Value {
                c.named(stringify!($name), |c| {
                    #[allow(unused_mut)]
                    let mut properties = serde_json::Map::new();
                    #[allow(unused_mut)]
                    let mut required: Vec<&str> = Vec::new();
                    $(
                        let name = stringify!($field).trim_start_matches("r#");
                        let mut s = <$ty as $crate::api::openapi::ApiSchema>::schema(c);
                        let d = $crate::api::openapi::doc_text(&[$($fdoc),*]);
                        if !d.is_empty() {
                            s = match s {
                                serde_json::Value::Object(mut o) if !o.contains_key("$ref") => {
                                    o.insert("description".into(), serde_json::json!(d));
                                    serde_json::Value::Object(o)
                                }
                                other => serde_json::json!({"allOf": [other], "description": d}),
                            };
                        }
                        properties.insert(name.to_string(), s);
                        if !<$ty as $crate::api::openapi::ApiSchema>::optional() {
                            required.push(name);
                        }
                    )*
                    let mut o = serde_json::json!({
                        "type": "object",
                        "properties": properties,
                        "required": required,
                    });
                    let d = $crate::api::openapi::doc_text(&[$($doc),*]);
                    if !d.is_empty() {
                        o["description"] = serde_json::json!(d);
                    }
                    if !$crate::api::openapi::api_object!(@kind $kind) {
                        o["additionalProperties"] = serde_json::json!(false);
                    }
                    o
                })
            }
        }
    };
    (@struct request, [$($doc:tt)*], $name:ident, [$( [$($fdoc:tt)*] [$($fattr:tt)*] $field:ident : $ty:ty ),*]) => {
        $($doc)*
        #[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        pub struct $name { $( $($fdoc)* $($fattr)* pub $field: $ty, )* }
    };
    (@struct $kind:ident, [$($doc:tt)*], $name:ident, [$( [$($fdoc:tt)*] [$($fattr:tt)*] $field:ident : $ty:ty ),*]) => {
        $($doc)*
        #[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
        pub struct $name { $( $($fdoc)* $($fattr)* pub $field: $ty, )* }
    };
}

pub(crate) use api_object;

/// A body of an operation.
pub enum Body {
    /// No body.
    None,
    /// `application/json` with this schema.
    Json(Value),
    /// Any other media type, described in words.
    Other(&'static str, Value),
    /// One of several media types (chosen by the request).
    Alternatives(Vec<(&'static str, Value)>),
}

impl Body {
    pub fn json<T: ApiSchema>(c: &mut Components) -> Body {
        Body::Json(T::schema(c))
    }

    fn content(&self) -> Option<Value> {
        match self {
            Body::None => None,
            Body::Json(s) => Some(json!({"application/json": {"schema": s}})),
            Body::Other(kind, s) => Some(json!({ *kind: {"schema": s} })),
            Body::Alternatives(list) => Some(Value::Object(
                list.iter()
                    .map(|(kind, s)| (kind.to_string(), json!({"schema": s})))
                    .collect(),
            )),
        }
    }
}

/// One operation of the document.
pub struct Operation {
    pub method: &'static str,
    pub path: &'static str,
    pub id: &'static str,
    pub summary: &'static str,
    /// Header and query parameters: `(name, in, description)`; path parameters are implied.
    pub params: Vec<(&'static str, &'static str, &'static str)>,
    pub request: Body,
    pub status: u16,
    /// Other success statuses answered with the same body (e.g. 200 beside 201 for a create
    /// that found what an earlier request had created).
    pub also: Vec<u16>,
    pub response: Body,
    /// Refusal statuses this operation may answer with (beyond 401).
    pub errors: Vec<u16>,
    /// The refusals' body schema, when not the document's own error body.
    pub error_body: Option<Value>,
    /// Response headers of the success: `(name, description)`.
    pub headers: Vec<(&'static str, &'static str)>,
    /// Response headers a refusal may carry (beyond `WWW-Authenticate` on 401).
    pub refusal_headers: Vec<(&'static str, &'static str)>,
}

/// An OpenAPI `headers` object: each header a string.
fn headers_object(list: &[(&str, &str)]) -> Value {
    Value::Object(
        list.iter()
            .map(|(name, desc)| {
                (
                    name.to_string(),
                    json!({"description": desc, "schema": {"type": "string"}}),
                )
            })
            .collect(),
    )
}

/// Does `schema` (or the component it names) require a field?
fn asks_for_a_field(c: &Components, schema: &Value) -> bool {
    let named = schema["$ref"]
        .as_str()
        .and_then(|r| r.strip_prefix("#/components/schemas/"))
        .and_then(|name| c.0.get(name));
    named
        .unwrap_or(schema)
        .get("required")
        .and_then(Value::as_array)
        .is_some_and(|fields| !fields.is_empty())
}

/// Assemble the document.
pub fn document(
    title: &str,
    version: &str,
    description: &str,
    operations: Vec<Operation>,
    mut c: Components,
    error: Value,
) -> Value {
    let mut paths = Map::new();
    for op in operations {
        let mut parameters: Vec<Value> = op
            .path
            .split('/')
            .filter_map(|seg| seg.strip_prefix('{').and_then(|s| s.strip_suffix('}')))
            .map(|name| json!({"name": name, "in": "path", "required": true, "schema": {"type": "string"}}))
            .collect();
        for (name, place, desc) in &op.params {
            parameters.push(json!({"name": name, "in": place, "required": false,
                                   "description": desc, "schema": {"type": "string"}}));
        }
        let mut responses = Map::new();
        let mut ok = json!({"description": http_reason(op.status)});
        if let Some(content) = op.response.content() {
            ok["content"] = content;
        }
        if !op.headers.is_empty() {
            ok["headers"] = headers_object(&op.headers);
        }
        for status in &op.also {
            let mut same = ok.clone();
            same["description"] = json!(http_reason(*status));
            responses.insert(status.to_string(), same);
        }
        responses.insert(op.status.to_string(), ok);
        let refusal = op.error_body.as_ref().unwrap_or(&error);
        // Every body is read within `http.body_timeout_seconds` of the headers, and up to its
        // route's size bound.
        let body = op.request.content().is_some();
        let body_refusals = [408, 413].into_iter().filter(|_| body);
        for status in std::iter::once(401)
            .chain(op.errors.iter().copied())
            .chain(body_refusals)
        {
            let mut refused = json!({"description": http_reason(status),
                                     "content": {"application/json": {"schema": refusal}}});
            let mut headers = op.refusal_headers.clone();
            match status {
                401 => headers.push(("WWW-Authenticate", "`Bearer`")),
                429 | 503 => headers.push(("Retry-After", "Seconds to wait before retrying")),
                _ => {}
            }
            if !headers.is_empty() {
                refused["headers"] = headers_object(&headers);
            }
            responses.insert(status.to_string(), refused);
        }
        // A route that takes a control-socket ticket in a header of its own (its exchange for
        // a token) authenticates by that ticket alone: a bearer key or token is no use there.
        let ticket_only = op.params.iter().any(|(name, place, _)| {
            *place == "header" && name.eq_ignore_ascii_case("X-Gatehouse-Ticket")
        });
        let security = if ticket_only {
            json!([{"ticket": []}])
        } else {
            json!([{"bearer": []}, {"ticket": []}])
        };
        let mut operation = json!({
            "operationId": op.id,
            "summary": op.summary,
            "parameters": parameters,
            "responses": responses,
            "security": security,
        });
        if let Some(content) = op.request.content() {
            // An empty body reads as `{}`: one whose object asks for no field may be left out.
            let required = match &op.request {
                Body::Json(schema) => asks_for_a_field(&c, schema),
                _ => true,
            };
            operation["requestBody"] = json!({"required": required, "content": content});
        }
        let item = paths
            .entry(op.path.to_string())
            .or_insert_with(|| json!({}));
        item[op.method] = operation;
    }
    let _ = c.named("Error", |_| error.clone());
    json!({
        "openapi": "3.1.0",
        "info": {"title": title, "version": version, "description": description},
        "paths": paths,
        "components": {
            "schemas": c.into_map(),
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer",
                           "description": "An API key (gatehouse key create) or a token from POST /v1/auth/token"},
                "ticket": {"type": "apiKey", "in": "header", "name": "X-Gatehouse-Ticket",
                           "description": "A single-use control-socket ticket (authenticates one request)"},
            },
        },
    })
}

fn http_reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        201 => "Created",
        202 => "Accepted",
        400 => "Bad request (invalid_params)",
        401 => "Missing, unknown or revoked credentials",
        403 => "permission_denied",
        404 => "not_found",
        409 => {
            "Conflict (admission_conflict, stale_generation, unknown_execution, profile_mismatch)"
        }
        408 => "The request body did not arrive in time (invalid_params)",
        413 => "payload_too_large",
        429 => "session_busy or rate_limited",
        503 => "runtime_draining or storage_unavailable",
        504 => "The turn did not finish in time",
        _ => "Response",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    api_object! {
        /// A thing.
        request struct Thing {
            /// Its name.
            name: String,
            count: Option<i64>,
            tags: Vec<String>,
            r#type: Option<Inner>,
        }
    }

    api_object! {
        response struct Inner {
            #[serde(skip_serializing_if = "Option::is_none")]
            note: Option<String>,
        }
    }

    #[test]
    fn schemas_follow_the_types() {
        let mut c = Components::default();
        let r = Thing::schema(&mut c);
        assert_eq!(r, json!({"$ref": "#/components/schemas/Thing"}));
        let m = c.into_map();
        let thing = &m["Thing"];
        assert_eq!(thing["required"], json!(["name", "tags"]));
        assert_eq!(thing["additionalProperties"], false);
        assert_eq!(thing["description"], "A thing.");
        assert_eq!(thing["properties"]["name"]["description"], "Its name.");
        assert_eq!(
            thing["properties"]["count"]["type"],
            json!(["integer", "null"])
        );
        assert_eq!(thing["properties"]["tags"]["items"]["type"], "string");
        assert_eq!(
            thing["properties"]["type"]["anyOf"][0]["$ref"],
            "#/components/schemas/Inner"
        );
        assert!(m["Inner"].get("additionalProperties").is_none());
        let t: Thing =
            serde_json::from_value(json!({"name": "a", "tags": [], "type": {}})).expect("parses");
        assert_eq!(t.r#type, Some(Inner { note: None }));
        assert!(serde_json::from_value::<Thing>(json!({"name": "a", "tags": [], "x": 1})).is_err());
        assert_eq!(
            serde_json::to_value(Inner { note: None }).expect("json"),
            json!({})
        );
    }
}
