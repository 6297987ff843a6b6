//! A request's priority, and why tongs refuses one itself.

pub use tongs_wire::header::Priority;

/// Why tongs refused a request itself (the `x-tongs-reject-reason` header and the JSON body say it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Refusal {
    /// The queue was full and the request could not displace anyone.
    QueueFull,
    /// The request waited `queue.max_wait`, or until its own deadline, without an endpoint freeing up.
    QueueTimeout,
    /// The queue stands above `queue.target_wait` under sustained overload, and this request would
    /// have waited longer: refused at arrival, with a `Retry-After` from how fast the queue drains.
    Overloaded,
    /// No endpoint is available at all (none discovered, or every one down) and the queue is off or the
    /// wait ran out.
    NoEndpoints,
    /// Congestion: low priority was refused, or displaced by a higher-priority request.
    ShedLowPriority,
    /// The request's tenant already has `max_queued` requests waiting (429).
    TenantQueueFull,
    /// The request's tenant already has `max_in_flight` requests in tongs (429; refused before any
    /// pool, so no queue counts it).
    TenantInFlight,
}

impl Refusal {
    /// The refusals a queue makes, in the order its counts keep them.
    pub const ALL: [Refusal; 6] = [
        Refusal::QueueFull,
        Refusal::QueueTimeout,
        Refusal::Overloaded,
        Refusal::NoEndpoints,
        Refusal::ShedLowPriority,
        Refusal::TenantQueueFull,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::QueueFull => "queue-full",
            Refusal::QueueTimeout => "queue-timeout",
            Refusal::Overloaded => "overloaded",
            Refusal::NoEndpoints => "no-endpoints",
            Refusal::ShedLowPriority => "shed-low-priority",
            Refusal::TenantQueueFull => "tenant-queue-full",
            Refusal::TenantInFlight => "tenant-in-flight",
        }
    }

    /// A refusal for the tenant's own cap, not for the fleet's state: 429 rather than 503.
    pub fn is_tenant_cap(self) -> bool {
        matches!(self, Refusal::TenantQueueFull | Refusal::TenantInFlight)
    }
}
