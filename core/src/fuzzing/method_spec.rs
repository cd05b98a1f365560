//! The methods nackd decodes, as a spec with every field free, and the
//! amq-protocol value each one stands for.

use amq_protocol::protocol::{basic, channel, confirm, connection, queue, tx, AMQPClass};

use super::value::{short, table, TableSpec, Text};

/// The methods nackd decodes, with every field free.
#[derive(Clone, Debug, arbitrary::Arbitrary)]
#[allow(missing_docs)]
pub enum MethodSpec {
    ConnectionStart {
        version: (u8, u8),
        server_properties: TableSpec,
        mechanisms: Vec<u8>,
        locales: Vec<u8>,
    },
    ConnectionStartOk {
        client_properties: TableSpec,
        mechanism: Text,
        response: Vec<u8>,
        locale: Text,
    },
    ConnectionTune {
        channel_max: u16,
        frame_max: u32,
        heartbeat: u16,
    },
    ConnectionTuneOk {
        channel_max: u16,
        frame_max: u32,
        heartbeat: u16,
    },
    ConnectionOpen {
        virtual_host: Text,
    },
    ConnectionOpenOk,
    ConnectionClose {
        reply_code: u16,
        reply_text: Text,
        class_id: u16,
        method_id: u16,
    },
    ConnectionCloseOk,
    ConnectionBlocked {
        reason: Text,
    },
    ConnectionUnblocked,
    ChannelOpen,
    ChannelOpenOk,
    ChannelClose {
        reply_code: u16,
        reply_text: Text,
        class_id: u16,
        method_id: u16,
    },
    ChannelCloseOk,
    /// flags: passive, durable, exclusive, auto-delete, no-wait.
    QueueDeclare {
        queue: Text,
        flags: [bool; 5],
        arguments: TableSpec,
    },
    QueueDeclareOk {
        queue: Text,
        message_count: u32,
        consumer_count: u32,
    },
    /// flags: no-local, no-ack, exclusive, no-wait.
    BasicConsume {
        queue: Text,
        consumer_tag: Text,
        flags: [bool; 4],
        arguments: TableSpec,
    },
    BasicConsumeOk {
        consumer_tag: Text,
    },
    BasicCancel {
        consumer_tag: Text,
        nowait: bool,
    },
    BasicCancelOk {
        consumer_tag: Text,
    },
    BasicDeliver {
        consumer_tag: Text,
        delivery_tag: u64,
        redelivered: bool,
        exchange: Text,
        routing_key: Text,
    },
    BasicGet {
        queue: Text,
        no_ack: bool,
    },
    BasicGetOk {
        delivery_tag: u64,
        redelivered: bool,
        exchange: Text,
        routing_key: Text,
        message_count: u32,
    },
    BasicGetEmpty,
    BasicAck {
        delivery_tag: u64,
        multiple: bool,
    },
    BasicReject {
        delivery_tag: u64,
        requeue: bool,
    },
    BasicRecoverAsync {
        requeue: bool,
    },
    BasicRecover {
        requeue: bool,
    },
    BasicRecoverOk,
    BasicNack {
        delivery_tag: u64,
        multiple: bool,
        requeue: bool,
    },
    TxSelect,
    TxSelectOk,
    ConfirmSelect {
        nowait: bool,
    },
    ConfirmSelectOk,
}

impl MethodSpec {
    /// The amq-protocol value of this method.
    // Whole because: one arm per method, each a field-for-field copy.
    #[allow(clippy::too_many_lines)]
    pub fn class(&self) -> AMQPClass {
        use basic::AMQPMethod as B;
        use connection::AMQPMethod as C;
        use AMQPClass::{Basic, Channel, Confirm, Connection, Queue, Tx};
        match self.clone() {
            Self::ConnectionStart {
                version,
                server_properties,
                mechanisms,
                locales,
            } => Connection(C::Start(connection::Start {
                version_major: version.0,
                version_minor: version.1,
                server_properties: table(&server_properties),
                mechanisms: mechanisms.into(),
                locales: locales.into(),
            })),
            Self::ConnectionStartOk {
                client_properties,
                mechanism,
                response,
                locale,
            } => Connection(C::StartOk(connection::StartOk {
                client_properties: table(&client_properties),
                mechanism: short(&mechanism),
                response: response.into(),
                locale: short(&locale),
            })),
            Self::ConnectionTune {
                channel_max,
                frame_max,
                heartbeat,
            } => Connection(C::Tune(connection::Tune {
                channel_max,
                frame_max,
                heartbeat,
            })),
            Self::ConnectionTuneOk {
                channel_max,
                frame_max,
                heartbeat,
            } => Connection(C::TuneOk(connection::TuneOk {
                channel_max,
                frame_max,
                heartbeat,
            })),
            Self::ConnectionOpen { virtual_host } => Connection(C::Open(connection::Open {
                virtual_host: short(&virtual_host),
            })),
            Self::ConnectionOpenOk => Connection(C::OpenOk(connection::OpenOk {})),
            Self::ConnectionClose {
                reply_code,
                reply_text,
                class_id,
                method_id,
            } => Connection(C::Close(connection::Close {
                reply_code,
                reply_text: short(&reply_text),
                class_id,
                method_id,
            })),
            Self::ConnectionCloseOk => Connection(C::CloseOk(connection::CloseOk {})),
            Self::ConnectionBlocked { reason } => Connection(C::Blocked(connection::Blocked {
                reason: short(&reason),
            })),
            Self::ConnectionUnblocked => Connection(C::Unblocked(connection::Unblocked {})),
            Self::ChannelOpen => Channel(channel::AMQPMethod::Open(channel::Open {})),
            Self::ChannelOpenOk => Channel(channel::AMQPMethod::OpenOk(channel::OpenOk {})),
            Self::ChannelClose {
                reply_code,
                reply_text,
                class_id,
                method_id,
            } => Channel(channel::AMQPMethod::Close(channel::Close {
                reply_code,
                reply_text: short(&reply_text),
                class_id,
                method_id,
            })),
            Self::ChannelCloseOk => Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})),
            Self::QueueDeclare {
                queue,
                flags: [passive, durable, exclusive, auto_delete, nowait],
                arguments,
            } => Queue(queue::AMQPMethod::Declare(queue::Declare {
                queue: short(&queue),
                passive,
                durable,
                exclusive,
                auto_delete,
                nowait,
                arguments: table(&arguments),
            })),
            Self::QueueDeclareOk {
                queue,
                message_count,
                consumer_count,
            } => Queue(queue::AMQPMethod::DeclareOk(queue::DeclareOk {
                queue: short(&queue),
                message_count,
                consumer_count,
            })),
            Self::BasicConsume {
                queue,
                consumer_tag,
                flags: [no_local, no_ack, exclusive, nowait],
                arguments,
            } => Basic(B::Consume(basic::Consume {
                queue: short(&queue),
                consumer_tag: short(&consumer_tag),
                no_local,
                no_ack,
                exclusive,
                nowait,
                arguments: table(&arguments),
            })),
            Self::BasicConsumeOk { consumer_tag } => Basic(B::ConsumeOk(basic::ConsumeOk {
                consumer_tag: short(&consumer_tag),
            })),
            Self::BasicCancel {
                consumer_tag,
                nowait,
            } => Basic(B::Cancel(basic::Cancel {
                consumer_tag: short(&consumer_tag),
                nowait,
            })),
            Self::BasicCancelOk { consumer_tag } => Basic(B::CancelOk(basic::CancelOk {
                consumer_tag: short(&consumer_tag),
            })),
            Self::BasicDeliver {
                consumer_tag,
                delivery_tag,
                redelivered,
                exchange,
                routing_key,
            } => Basic(B::Deliver(basic::Deliver {
                consumer_tag: short(&consumer_tag),
                delivery_tag,
                redelivered,
                exchange: short(&exchange),
                routing_key: short(&routing_key),
            })),
            Self::BasicGet { queue, no_ack } => Basic(B::Get(basic::Get {
                queue: short(&queue),
                no_ack,
            })),
            Self::BasicGetOk {
                delivery_tag,
                redelivered,
                exchange,
                routing_key,
                message_count,
            } => Basic(B::GetOk(basic::GetOk {
                delivery_tag,
                redelivered,
                exchange: short(&exchange),
                routing_key: short(&routing_key),
                message_count,
            })),
            Self::BasicGetEmpty => Basic(B::GetEmpty(basic::GetEmpty {})),
            Self::BasicAck {
                delivery_tag,
                multiple,
            } => Basic(B::Ack(basic::Ack {
                delivery_tag,
                multiple,
            })),
            Self::BasicReject {
                delivery_tag,
                requeue,
            } => Basic(B::Reject(basic::Reject {
                delivery_tag,
                requeue,
            })),
            Self::BasicRecoverAsync { requeue } => {
                Basic(B::RecoverAsync(basic::RecoverAsync { requeue }))
            }
            Self::BasicRecover { requeue } => Basic(B::Recover(basic::Recover { requeue })),
            Self::BasicRecoverOk => Basic(B::RecoverOk(basic::RecoverOk {})),
            Self::BasicNack {
                delivery_tag,
                multiple,
                requeue,
            } => Basic(B::Nack(basic::Nack {
                delivery_tag,
                multiple,
                requeue,
            })),
            Self::TxSelect => Tx(tx::AMQPMethod::Select(tx::Select {})),
            Self::TxSelectOk => Tx(tx::AMQPMethod::SelectOk(tx::SelectOk {})),
            Self::ConfirmSelect { nowait } => {
                Confirm(confirm::AMQPMethod::Select(confirm::Select { nowait }))
            }
            Self::ConfirmSelectOk => Confirm(confirm::AMQPMethod::SelectOk(confirm::SelectOk {})),
        }
    }
}
